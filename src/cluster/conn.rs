//! The link's connections, one Redis or a Redis Cluster behind one type, so the link's code
//! is the same on both (the engine is chosen once, in main.rs).
//!
//! - Commands: [`Conn`], a multiplexed connection to one Redis or the redis crate's
//!   `ClusterConnection` (seeds, `CLUSTER SLOTS` discovery, routing by key slot,
//!   `MOVED`/`ASK`, reconnection per node; docs/design/redis-cluster.md §1). Pipelines the
//!   crate would refuse on a cluster (keys of several slots, or a session transaction that
//!   also publishes on a control channel, whose name the crate takes for a key) are sent
//!   with an explicit route: [`Conn::at`] (the master of one key's slot), [`Conn::each`]
//!   (every command to its own node).
//! - Pub/sub: classic `SUBSCRIBE` on one connection; on a cluster to the first seed that
//!   answers, since the cluster bus copies every `PUBLISH` to every node.

use std::time::Duration;

use futures_util::FutureExt;
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, Pipeline, RedisFuture, RedisResult, Value};

/// Which Redis side this instance shares state over.
#[derive(Debug, Clone)]
pub enum Engine {
    /// `--redis-url`.
    Single(String),
    /// `--redis-cluster-nodes`: the seeds.
    Sharded(Vec<String>),
}

impl Engine {
    pub fn is_cluster(&self) -> bool {
        matches!(self, Engine::Sharded(_))
    }

    /// The flag the engine came from, for error messages.
    pub fn flag(&self) -> &'static str {
        match self {
            Engine::Single(_) => "--redis-url",
            Engine::Sharded(_) => "--redis-cluster-nodes",
        }
    }
}

fn tls(ca: &[u8]) -> redis::TlsCertificates {
    redis::TlsCertificates { client_tls: None, root_cert: Some(ca.to_vec()) }
}

fn client(url: &str, ca: Option<&[u8]>) -> RedisResult<redis::Client> {
    match ca {
        Some(ca) => redis::Client::build_with_tls(url, tls(ca)),
        None => redis::Client::open(url),
    }
}

/// The cluster client for the seeds (checked at start-up too: a seed the crate cannot read
/// stops hubcast, naming the flag).
pub fn cluster_client(seeds: &[String], ca: Option<&[u8]>, deadline: Duration) -> RedisResult<redis::cluster::ClusterClient> {
    let mut builder = redis::cluster::ClusterClientBuilder::new(seeds.to_vec()).connection_timeout(deadline).response_timeout(deadline);
    if let Some(ca) = ca {
        builder = builder.certs(tls(ca));
    }
    builder.build()
}

/// Checks the engine's URLs as the redis crate reads them; `Err` names the flag.
pub fn check(engine: &Engine, ca: Option<&[u8]>) -> Result<(), String> {
    let checked = match engine {
        Engine::Single(url) => client(url, ca).map(drop),
        Engine::Sharded(seeds) => cluster_client(seeds, ca, Duration::from_secs(5)).map(drop),
    };
    checked.map_err(|e| format!("invalid {}: {e}", engine.flag()))
}

/// The command connection.
#[derive(Clone)]
pub(crate) enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

/// Connects the command connection; `deadline` bounds each call (connect and answers).
pub(crate) async fn connect(engine: &Engine, ca: Option<&[u8]>, deadline: Duration) -> RedisResult<Conn> {
    match engine {
        Engine::Single(url) => {
            let config = redis::AsyncConnectionConfig::new().set_connection_timeout(Some(deadline)).set_response_timeout(Some(deadline));
            Ok(Conn::Single(client(url, ca)?.get_multiplexed_async_connection_with_config(&config).await?))
        }
        Engine::Sharded(seeds) => Ok(Conn::Cluster(cluster_client(seeds, ca, deadline)?.get_async_connection().await?)),
    }
}

/// Connects the pub/sub connection: on a cluster to the first seed that answers.
pub(crate) async fn pubsub(engine: &Engine, ca: Option<&[u8]>, deadline: Duration) -> RedisResult<redis::aio::PubSub> {
    match engine {
        Engine::Single(url) => client(url, ca)?.get_async_pubsub().await,
        Engine::Sharded(seeds) => {
            let mut last = None;
            for seed in seeds {
                let attempt = async { client(seed, ca)?.get_async_pubsub().await };
                match tokio::time::timeout(deadline, attempt).await {
                    Ok(Ok(pubsub)) => return Ok(pubsub),
                    Ok(Err(e)) => last = Some(e),
                    Err(_) => last = Some(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("{seed}: no answer")).into()),
                }
            }
            Err(last.unwrap_or_else(|| std::io::Error::other("no seed").into()))
        }
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(&'a mut self, pipeline: &'a Pipeline, offset: usize, count: usize) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// [`Conn`] with pipelines sent to one chosen node (see [`Conn::at`]).
pub(crate) struct At<'a> {
    conn: &'a mut Conn,
    route: Route,
}

impl ConnectionLike for At<'_> {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        self.conn.req_packed_command(cmd)
    }

    fn req_packed_commands<'a>(&'a mut self, pipeline: &'a Pipeline, offset: usize, count: usize) -> RedisFuture<'a, Vec<Value>> {
        match &mut self.conn {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => {
                let route = SingleNodeRoutingInfo::SpecificNode(self.route);
                async move { c.route_pipeline(pipeline.clone(), offset, count, route).await }.boxed()
            }
        }
    }

    fn get_db(&self) -> i64 {
        self.conn.get_db()
    }
}

impl Conn {
    /// Pipelines to the master of `key`'s slot (one Redis: itself): a session's transaction,
    /// publications on many channels through one node.
    pub(crate) fn at(&mut self, key: &str) -> At<'_> {
        At { conn: self, route: Route::with_key(key, SlotAddr::Master) }
    }

    /// The commands of `pipe`, none of whose answers is wanted: one pipeline on one Redis;
    /// on a cluster each command to the master of its own key, all at once.
    pub(crate) async fn each(&mut self, pipe: &Pipeline) -> RedisResult<()> {
        match self {
            Conn::Single(_) => pipe.query_async::<()>(self).await,
            Conn::Cluster(c) => {
                let sent = pipe.cmd_iter().map(|cmd| {
                    let mut c = c.clone();
                    async move { cmd.query_async::<Value>(&mut c).await }
                });
                for answer in futures_util::future::join_all(sent).await {
                    answer?;
                }
                Ok(())
            }
        }
    }

    /// Every key matching `pattern` (`SCAN`; on a cluster on each master).
    pub(crate) async fn scan(&mut self, pattern: &str) -> RedisResult<Vec<String>> {
        let mut out = Vec::new();
        let nodes = match self {
            Conn::Single(_) => vec![None],
            Conn::Cluster(c) => masters(c).await?.into_iter().map(Some).collect(),
        };
        for node in nodes {
            let mut cursor: u64 = 0;
            loop {
                let scan = redis::cmd("SCAN").arg(cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(1000).to_owned();
                let (next, keys): (u64, Vec<String>) = match (&mut *self, &node) {
                    (Conn::Cluster(c), Some((host, port))) => {
                        let at = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host: host.clone(), port: *port });
                        redis::from_redis_value(c.route_command(scan, at).await?)?
                    }
                    (conn, _) => scan.query_async(conn).await?,
                };
                out.extend(keys);
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(out)
    }
}

/// The slot map, from `CLUSTER SLOTS` (`[start, end, [host, port, id], replicas…]`):
/// `(first slot, last slot, master)`, sorted by slot.
pub(crate) async fn slot_map(conn: &mut Conn) -> RedisResult<Vec<(u16, u16, (String, u16))>> {
    let Conn::Cluster(c) = conn else { return Ok(Vec::new()) };
    let slots = c.route_command(redis::cmd("CLUSTER").arg("SLOTS").to_owned(), RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random)).await?;
    let ranges: Vec<Vec<Value>> = redis::from_redis_value(slots)?;
    let mut out = Vec::new();
    for range in ranges {
        let (Some(first), Some(last), Some(Value::Array(master))) = (range.first(), range.get(1), range.get(2)) else { continue };
        if let (Some(host), Some(port)) = (master.first(), master.get(1)) {
            let first: u16 = redis::from_redis_value_ref(first)?;
            let last: u16 = redis::from_redis_value_ref(last)?;
            out.push((first, last, (redis::from_redis_value_ref(host)?, redis::from_redis_value_ref(port)?)));
        }
    }
    out.sort();
    Ok(out)
}

/// The masters' addresses, from `CLUSTER SLOTS` (`[start, end, [host, port, id], replicas…]`).
async fn masters(c: &mut ClusterConnection) -> RedisResult<Vec<(String, u16)>> {
    let slots = c.route_command(redis::cmd("CLUSTER").arg("SLOTS").to_owned(), RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random)).await?;
    let ranges: Vec<Vec<Value>> = redis::from_redis_value(slots)?;
    let mut out: Vec<(String, u16)> = Vec::new();
    for range in ranges {
        let Some(Value::Array(master)) = range.get(2) else {
            continue;
        };
        if let (Some(host), Some(port)) = (master.first(), master.get(1)) {
            let host: String = redis::from_redis_value(host.clone())?;
            let port: u16 = redis::from_redis_value(port.clone())?;
            if !out.contains(&(host.clone(), port)) {
                out.push((host, port));
            }
        }
    }
    Ok(out)
}
