//! Command line: global options (which hubcast, how long, where the JSON goes) and one
//! subcommand per mode.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::fleet::{FleetPlan, Via};
use crate::pin::Pinning;
use crate::target::TargetSpec;
use crate::ws::Transport;

#[derive(Parser, Debug)]
#[command(
    name = "hubcast-load",
    version,
    about = "Load harness for hubcast: drives a hubcast on this machine's loopback over its real interfaces",
    after_help = "Start hubcast yourself (--url, --pid) or let the harness start it (--spawn target/release/hubcast --cores 2).\n\
                  Every mode is bounded by --warmup + --duration and by its counts. See docs/BENCHMARKS.md."
)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub mode: Mode,
}

#[derive(Args, Debug, Clone)]
pub struct Global {
    /// Address of a running hubcast (loopback only); ignored with --spawn.
    #[arg(long, global = true, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// hubcast's admin key (Shared-Access-Key); with --spawn, the key it is started with.
    #[arg(long, global = true, env = "HUBCAST_ADMIN_KEY", default_value = "hubcast-load-key")]
    pub admin_key: String,
    /// pid of a running hubcast, for its CPU time and RSS (/proc/<pid>/stat, status).
    #[arg(long, global = true)]
    pub pid: Option<u32>,
    /// Start this hubcast binary on 127.0.0.1 with a free port (and stop it at the end).
    #[arg(long, global = true, value_name = "PATH")]
    pub spawn: Option<String>,
    /// --cores for a spawned hubcast.
    #[arg(long, global = true)]
    pub cores: Option<usize>,
    /// One more argument for a spawned hubcast (repeat it: --hubcast-arg=--throttling-interval --hubcast-arg=100).
    #[arg(long = "hubcast-arg", global = true, allow_hyphen_values = true, value_name = "ARG")]
    pub hubcast_args: Vec<String>,
    /// Seconds measured (per step).
    #[arg(long, global = true, default_value_t = 5.0)]
    pub duration: f64,
    /// Seconds of load before measuring (per step).
    #[arg(long, global = true, default_value_t = 1.0)]
    pub warmup: f64,
    /// Also write the results as JSON to this file.
    #[arg(long, global = true, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Worker threads of the harness's runtime.
    #[arg(long, global = true, default_value_t = 2)]
    pub threads: usize,
    /// Pin hubcast and the harness to separate CPUs (like `taskset -c`): hubcast to the first
    /// --cores CPUs (1 without --cores), the harness to the others.
    #[arg(long, global = true)]
    pub pin: bool,
    /// With --pin: hubcast's CPUs instead (a taskset list: 0 or 0,2-3).
    #[arg(long, global = true, value_name = "LIST", requires = "pin")]
    pub hubcast_cpus: Option<String>,
    /// With --pin: the harness's CPUs instead (default: every CPU hubcast does not have).
    #[arg(long, global = true, value_name = "LIST", requires = "pin")]
    pub harness_cpus: Option<String>,
    /// Fan-out: a shell command run just before and just after each measured window
    /// (env HUBCAST_LOAD_STEP=begin|end, HUBCAST_LOAD_RATE), e.g. to read Redis's INFO there.
    #[arg(long, global = true, value_name = "CMD")]
    pub step_hook: Option<String>,
}

impl Global {
    /// Where --pin puts each side (`None` without --pin).
    pub fn pinning(&self) -> std::io::Result<Option<Pinning>> {
        if !self.pin {
            return Ok(None);
        }
        Pinning::plan(self.hubcast_cpus.as_deref(), self.harness_cpus.as_deref(), self.cores, crate::pin::online_cpus()).map(Some)
    }

    pub fn target_spec(&self) -> TargetSpec {
        TargetSpec {
            url: Some(self.url.clone()),
            admin_key: self.admin_key.clone(),
            pid: self.pid,
            spawn: self.spawn.clone(),
            cores: self.cores,
            extra_args: self.hubcast_args.clone(),
            // Checked in `run` before anything starts (and the same every time it is made).
            cpus: self.pinning().expect("--pin was checked at start").map(|p| p.hubcast),
        }
    }
}

#[derive(Subcommand, Debug, Clone)]
pub enum Mode {
    /// Device fleet only: ingested messages/s (from hubcast_messages_in_total deltas).
    Ingest(FleetArgs),
    /// C clients × S devices each, the fleet at one or more rates: delivered messages/s and latency.
    Fanout(FanoutArgs),
    /// C idle sockets: connect rate and hubcast's RSS.
    Idle(IdleArgs),
    /// Closed-loop keep-alive clients: GET /version (hello world) against GET /lastValue/:id.
    Rest(RestArgs),
    /// The whole suite of docs/BENCHMARKS.md, with the ratios, each part on a fresh hubcast (needs --spawn).
    All(AllArgs),
    /// Fleet scale (issue 25 item 5): D devices over AMQP, S sockets × subs, the store on, on
    /// 1 or N instances on a private Redis: memory per device and socket, store bytes, fan-out,
    /// kill -9 and restart (needs --spawn). docs/benchmarks/fleet.sh.
    Fleet(crate::scale::ScaleArgs),
    /// `fanout`'s shapes against a peer broker over its WebSocket listener (NATS or Mosquitto,
    /// started here on free ports, pinned like hubcast with --pin): issue 25's side-by-side
    /// table. docs/benchmarks/peers.sh.
    Peer(PeerArgs),
}

#[derive(Args, Debug, Clone)]
pub struct PeerArgs {
    /// Which broker.
    #[arg(long, value_enum)]
    pub peer: crate::peers::Peer,
    /// Its binary (default: /usr/sbin/nats-server, /usr/sbin/mosquitto).
    #[arg(long, value_name = "PATH")]
    pub peer_bin: Option<String>,
    /// Subscriber connections (`fanout`'s clients).
    #[arg(long, default_value_t = 100)]
    pub clients: usize,
    /// Devices (subjects / topics) each subscriber subscribes to.
    #[arg(long, default_value_t = 1)]
    pub subs: usize,
    /// Devices the publishers send for (round-robin).
    #[arg(long, default_value_t = 1000)]
    pub devices: usize,
    /// Messages per second in total; 0 = as fast as the broker answers. A comma list runs one step per rate.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub rate: Vec<f64>,
    /// Messages per publisher write (one send time each batch), as `fanout --batch`.
    #[arg(long, default_value_t = 500)]
    pub batch: usize,
    /// Publisher connections, as `fanout --fleet-conns`.
    #[arg(long, default_value_t = 4)]
    pub fleet_conns: usize,
    /// Batches a publisher may have unanswered (a PING / PINGREQ after each), as `fanout --pipeline`.
    #[arg(long, default_value_t = 1)]
    pub pipeline: usize,
    /// Subscriber handshakes in flight at once.
    #[arg(long, default_value_t = 256)]
    pub connect_concurrency: usize,
}

#[derive(Args, Debug, Clone)]
pub struct FleetArgs {
    /// How the fleet sends: POST /ingest, or an AMQP 1.0 Event Hubs-like endpoint the harness serves.
    #[arg(long = "fleet", value_enum, default_value_t = Via::Http)]
    pub via: Via,
    /// Devices in the fleet.
    #[arg(long, default_value_t = 1000)]
    pub devices: usize,
    /// Messages per second in total; 0 = as fast as hubcast takes them. Fanout: a comma list runs one step per rate.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub rate: Vec<f64>,
    /// Messages per POST /ingest.
    #[arg(long, default_value_t = 500)]
    pub batch: usize,
    /// Keep-alive connections posting batches.
    #[arg(long, default_value_t = 4)]
    pub fleet_conns: usize,
    /// Partitions of the AMQP endpoint.
    #[arg(long, default_value_t = 4)]
    pub partitions: usize,
    /// Port of the AMQP endpoint (0: any; give one when hubcast is started by hand).
    #[arg(long, default_value_t = 0)]
    pub amqp_port: u16,
    /// --event-hub-prefetch (link credit per partition) for a spawned hubcast.
    #[arg(long, default_value_t = 2000)]
    pub prefetch: u32,
    /// HTTP fleet: batches in flight per connection (pipelined, answers read in order); 1 waits for each answer.
    #[arg(long, default_value_t = 1)]
    pub pipeline: usize,
    /// HTTP fleet: post to this hubcast instead of --target (another instance on the same
    /// Redis: every message then crosses to the clients' instance; docs/benchmarks/redis-*.sh).
    #[arg(long, value_name = "URL")]
    pub fleet_target: Option<String>,
}

impl FleetArgs {
    pub fn plan(&self, rate: f64) -> FleetPlan {
        FleetPlan {
            via: self.via,
            devices: self.devices,
            rate,
            batch: self.batch,
            conns: self.fleet_conns,
            partitions: self.partitions,
            pipeline: self.pipeline,
        }
    }
}

#[derive(Args, Debug, Clone)]
pub struct FanoutArgs {
    #[command(flatten)]
    pub fleet: FleetArgs,
    /// Clients (one session and one socket each).
    #[arg(long, default_value_t = 100)]
    pub clients: usize,
    /// Devices each client subscribes to.
    #[arg(long, default_value_t = 1)]
    pub subs: usize,
    #[arg(long, value_enum, default_value_t = Transport::Ws)]
    pub transport: Transport,
    /// Keep-alive connections for the set-up requests.
    #[arg(long, default_value_t = 8)]
    pub setup_conns: usize,
    /// WebSocket handshakes in flight at once.
    #[arg(long, default_value_t = 256)]
    pub connect_concurrency: usize,
}

#[derive(Args, Debug, Clone)]
pub struct IdleArgs {
    /// Idle sockets to open (each with its own session).
    #[arg(long, default_value_t = 1000)]
    pub clients: usize,
    /// Grants and subscriptions per session (a wildcard telemetry grant and a subscription
    /// on each of `subs` devices, as `fanout` sets them up); 0: bare sessions.
    #[arg(long, default_value_t = 0)]
    pub subs: usize,
    /// Devices the grants and subscriptions are spread over (with `--subs`).
    #[arg(long, default_value_t = 1000)]
    pub devices: usize,
    #[arg(long, value_enum, default_value_t = Transport::Ws)]
    pub transport: Transport,
    #[arg(long, default_value_t = 8)]
    pub setup_conns: usize,
    #[arg(long, default_value_t = 256)]
    pub connect_concurrency: usize,
}

#[derive(Args, Debug, Clone)]
pub struct RestArgs {
    /// Closed-loop keep-alive connections.
    #[arg(long, default_value_t = 32)]
    pub conns: usize,
    /// Devices read by GET /lastValue (one message each is ingested first).
    #[arg(long, default_value_t = 100)]
    pub devices: usize,
    /// Alternations of the two routes (each gets duration / 2 in total).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
}

#[derive(Args, Debug, Clone)]
pub struct AllArgs {
    /// Scales every count (clients, devices, sockets): 1 for the report, 0.01 for a smoke run.
    #[arg(long, default_value_t = 1.0)]
    pub scale: f64,
    /// Fan-out fleet rates to ramp through (messages/s before scaling by subscribers).
    #[arg(long, value_delimiter = ',', default_value = "250,500,1000,2000")]
    pub ramp: Vec<f64>,
    /// Idle sockets (capped by the open-file limit of both processes).
    #[arg(long, default_value_t = 50_000)]
    pub idle: usize,
    /// Skip the AMQP fleet.
    #[arg(long)]
    pub no_amqp: bool,
}
