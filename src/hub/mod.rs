//! The IoT Hub service REST client: twin reads, desired-property patches, direct methods.
//!
//! The cores never wait on the hub's sockets. The HTTPS client (reqwest over rustls, pooled
//! keep-alive HTTP/1.1 connections) runs on its own thread with a tokio runtime. A core hands a
//! [`HubCall`] to [`HubClient::call`], which puts it on a bounded queue and awaits the answer on
//! a oneshot channel (both wake a monoio task from another thread). On the hub thread,
//! `maxConcurrency` workers take calls off the queue, one at a time each.
//!
//! Back-pressure, by design: at most `iot-hub-max-concurrency` requests are in flight (so at
//! most that many sockets to the hub) and at most `iot-hub-queue-size` wait behind them. A full
//! queue is refused at once with 503 "IoT Hub client busy"; every call carries a deadline from
//! the moment it is queued, and a call that reaches it, queued or in flight, ends with 504. A
//! slow or dead hub therefore costs a bounded amount of memory and sockets, never a core.

pub mod api;
pub mod sas;

use std::io;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_channel::oneshot;

pub use api::{HubAnswer, HubCall, HubResult};

use crate::config::Settings;
use crate::model::Rejection;
use sas::{Signer, TokenCache};

/// TCP + TLS connect timeout to the hub.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Idle pooled connections are closed after this long.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Added to a direct method's `responseTimeoutInSeconds + connectTimeoutInSeconds`: the hub
/// answers 504 itself at that point, this leaves room for the round trip. The default of the
/// hidden `--iot-hub-method-timeout-margin-ms` (tests shorten it).
pub const METHOD_TIMEOUT_MARGIN: Duration = Duration::from_secs(5);
/// Upper bound of a direct method's `responseTimeoutInSeconds` and `connectTimeoutInSeconds`
/// (IoT Hub's own limit) when computing our deadline.
pub const METHOD_TIMEOUT_MAX_SECS: f64 = 300.0;

/// Everything the client needs, derived from the configuration.
pub struct HubOptions {
    /// Base URL without a trailing slash: `https://<HostName>` or `--iot-hub-service-url`.
    pub base_url: String,
    pub signer: Signer,
    pub token_lifetime_secs: u64,
    pub max_concurrency: usize,
    pub queue_size: usize,
    pub timeout: Duration,
    /// Added to a direct method's device timeouts ([`METHOD_TIMEOUT_MARGIN`] unless overridden).
    pub method_margin: Duration,
}

impl HubOptions {
    /// `Ok(None)` without a (well-formed) service connection string; `Err` for a hub URL
    /// that cannot be used (start-up stops with that message).
    pub fn from_settings(settings: &Settings) -> Result<Option<Self>, String> {
        let c = &settings.config;
        let Some(Ok(service)) = &settings.service else {
            if c.iot_hub_service_url.is_some() {
                tracing::warn!("--iot-hub-service-url is set without a usable iotHubServiceConnectionString; ignored");
            }
            return Ok(None);
        };
        let base_url = match &c.iot_hub_service_url {
            Some(url) => checked_base_url(url, c.iot_hub_allow_insecure_http)?,
            None => format!("https://{}", service.host_name),
        };
        Ok(Some(Self {
            base_url,
            signer: Signer::new(&service.host_name, &service.key_name, &service.key)?,
            token_lifetime_secs: c.iot_hub_sas_token_lifetime,
            max_concurrency: c.iot_hub_max_concurrency as usize,
            queue_size: c.iot_hub_queue_size as usize,
            timeout: Duration::from_secs(c.iot_hub_timeout),
            method_margin: Duration::from_millis(c.iot_hub_method_timeout_margin_ms),
        }))
    }
}

/// Validates `--iot-hub-service-url`: https (http only when explicitly allowed), a host, no
/// query or fragment. Returns it without a trailing slash.
fn checked_base_url(raw: &str, allow_http: bool) -> Result<String, String> {
    let url = reqwest::Url::parse(raw.trim()).map_err(|e| format!("--iot-hub-service-url `{raw}` is not a URL ({e})"))?;
    match url.scheme() {
        "https" => {}
        "http" if allow_http => tracing::warn!(url = raw, "IoT Hub service API over plain http (allowed by --iot-hub-allow-insecure-http)"),
        "http" => {
            return Err(format!(
                "--iot-hub-service-url `{raw}` uses plain http, which would send the SAS token unencrypted; \
                 use https, or pass --iot-hub-allow-insecure-http for a local test double"
            ))
        }
        other => return Err(format!("--iot-hub-service-url `{raw}`: scheme `{other}` is not https")),
    }
    if url.host_str().is_none() || url.query().is_some() || url.fragment().is_some() {
        return Err(format!("--iot-hub-service-url `{raw}` must be a base URL with a host and no query"));
    }
    Ok(url.as_str().trim_end_matches('/').to_string())
}

/// A call waiting for (or being handled by) a worker.
struct Job {
    call: HubCall,
    deadline: Instant,
    budget: Duration,
    reply: oneshot::Sender<HubResult>,
}

/// The cores' handle to the hub thread; cheap to clone.
#[derive(Clone)]
pub struct HubClient {
    queue: async_channel::Sender<Job>,
    timeout: Duration,
    method_margin: Duration,
}

impl HubClient {
    /// Builds the HTTPS client and starts the hub thread.
    pub fn start(options: HubOptions) -> io::Result<Self> {
        let http = reqwest::Client::builder()
            .use_rustls_tls()
            .https_only(!options.base_url.starts_with("http://"))
            .connect_timeout(CONNECT_TIMEOUT)
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .pool_max_idle_per_host(options.max_concurrency)
            .tcp_nodelay(true)
            // A redirect would carry the SAS token to another host: never follow one.
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .user_agent(concat!("hubcast/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(io::Error::other)?;
        let (tx, rx) = async_channel::bounded::<Job>(options.queue_size);
        let tokens = Arc::new(Mutex::new(TokenCache::new(options.signer, options.token_lifetime_secs)));
        let base = Arc::<str>::from(options.base_url.as_str());
        let workers = options.max_concurrency;
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        std::thread::Builder::new().name("hubcast-hub".into()).spawn(move || {
            runtime.block_on(async move {
                let handles: Vec<_> = (0..workers)
                    .map(|_| tokio::spawn(worker(rx.clone(), http.clone(), base.clone(), tokens.clone())))
                    .collect();
                for h in handles {
                    let _ = h.await;
                }
            });
        })?;
        tracing::info!(
            url = options.base_url,
            concurrency = options.max_concurrency,
            queue = options.queue_size,
            "IoT Hub service client started"
        );
        Ok(Self { queue: tx, timeout: options.timeout, method_margin: options.method_margin })
    }

    /// The deadline of twin reads and patches (`--iot-hub-timeout`).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Added to a direct method's device timeouts: see [`method_budget`].
    pub fn method_margin(&self) -> Duration {
        self.method_margin
    }

    /// Calls waiting for a worker (not yet sent to the hub).
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// The client's gauges as `GET /metrics` series.
    pub fn series(&self) -> crate::metrics::ExternalSeries {
        vec![(
            "hubcast_iot_hub_queued_requests".into(),
            "IoT Hub service calls waiting for a free worker (at most --iot-hub-queue-size).".into(),
            String::new(),
            self.queued() as u64,
        )]
    }

    /// Runs `call` on the hub thread; answers within `budget` (plus a little) in every case.
    pub async fn call(&self, call: HubCall, budget: Duration) -> HubResult {
        let (reply, answer) = oneshot::channel();
        let name = call.name();
        let job = Job { call, deadline: Instant::now() + budget, budget, reply };
        if let Err(e) = self.queue.try_send(job) {
            return Err(if e.is_full() {
                // debug, not warn: under overload this would log once per refused request.
                tracing::debug!(call = name, "IoT Hub client busy: queue full");
                Rejection::new(503, "IoT Hub client busy: too many requests waiting for the IoT Hub; try again later")
            } else {
                Rejection::new(503, "IoT Hub client stopped")
            });
        }
        // The hub thread answers by the deadline; this bound only guards against it dying.
        match monoio::time::timeout(budget + Duration::from_secs(2), answer).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(Rejection::new(503, "IoT Hub client stopped")),
            Err(_) => Err(timed_out(budget)),
        }
    }
}

/// The deadline for a direct method: the device's response and connect timeouts (hub
/// defaults 30 and 0, each capped at 300 s) plus `margin` (normally [`METHOD_TIMEOUT_MARGIN`]).
pub fn method_budget(response_timeout: Option<f64>, connect_timeout: Option<f64>, margin: Duration) -> Duration {
    let clamp = |v: f64| if v.is_finite() { v.clamp(0.0, METHOD_TIMEOUT_MAX_SECS) } else { 0.0 };
    let secs = clamp(response_timeout.unwrap_or(30.0)) + clamp(connect_timeout.unwrap_or(0.0));
    Duration::from_secs_f64(secs) + margin
}

fn timed_out(budget: Duration) -> Rejection {
    Rejection::new(504, format!("IoT Hub did not answer within {} s", budget.as_secs_f64().ceil()))
}

fn now_millis() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// One worker: one request at a time, until the queue closes.
async fn worker(queue: async_channel::Receiver<Job>, http: reqwest::Client, base: Arc<str>, tokens: Arc<Mutex<TokenCache>>) {
    while let Ok(job) = queue.recv().await {
        if job.reply.is_canceled() {
            continue;
        }
        let result = if Instant::now() >= job.deadline {
            Err(timed_out(job.budget))
        } else {
            let deadline = tokio::time::Instant::from_std(job.deadline);
            match tokio::time::timeout_at(deadline, execute(&http, &base, &tokens, &job.call)).await {
                Ok(result) => result,
                Err(_) => Err(timed_out(job.budget)),
            }
        };
        match &result {
            Ok(answer) => tracing::debug!(call = job.call.name(), status = answer.status, "IoT Hub answered"),
            Err(r) if r.status >= 500 => {
                tracing::warn!(call = job.call.name(), status = r.status, error = r.message, "IoT Hub call failed")
            }
            Err(r) => tracing::debug!(call = job.call.name(), status = r.status, error = r.message, "IoT Hub refused"),
        }
        let _ = job.reply.send(result);
    }
}

/// One request: sign, send, read the answer (bounded), interpret.
async fn execute(http: &reqwest::Client, base: &str, tokens: &Mutex<TokenCache>, call: &HubCall) -> HubResult {
    let token = tokens.lock().unwrap_or_else(|e| e.into_inner()).get(now_millis()).to_string();
    let url = format!("{base}{}", call.path_and_query());
    let mut request = http
        .request(call.method(), url)
        .header(reqwest::header::AUTHORIZATION, token)
        .header(reqwest::header::ACCEPT, "application/json");
    if let Some(body) = call.body() {
        request = request.header(reqwest::header::CONTENT_TYPE, "application/json; charset=utf-8").body(body);
    }
    if matches!(call, HubCall::PatchDesired { .. }) {
        // Patch whatever the current version is (no optimistic concurrency across callers).
        request = request.header(reqwest::header::IF_MATCH, "*");
    }
    let mut response = request.send().await.map_err(transport_error)?;
    let status = response.status().as_u16();
    let error_code = response.headers().get("iothub-errorcode").and_then(|v| v.to_str().ok()).map(str::to_string);
    if response.content_length().is_some_and(|n| n > api::MAX_RESPONSE_BYTES as u64) {
        return Err(too_large());
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(transport_error)? {
        if body.len() + chunk.len() > api::MAX_RESPONSE_BYTES {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    api::interpret(status, error_code.as_deref(), &body)
}

fn too_large() -> Rejection {
    Rejection::new(502, format!("IoT Hub answer is larger than {} bytes", api::MAX_RESPONSE_BYTES))
}

/// No HTTP answer: unreachable (503), timed out (504), or broken off (502).
fn transport_error(e: reqwest::Error) -> Rejection {
    let mut detail = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        detail.push_str(": ");
        detail.push_str(&s.to_string());
        source = s.source();
    }
    if e.is_timeout() {
        Rejection::new(504, format!("IoT Hub did not answer in time ({detail})"))
    } else if e.is_connect() {
        Rejection::new(503, format!("IoT Hub unreachable ({detail})"))
    } else {
        Rejection::new(502, format!("IoT Hub request failed ({detail})"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_http_is_refused_unless_allowed() {
        let err = checked_base_url("http://127.0.0.1:1234", false).unwrap_err();
        assert!(err.contains("--iot-hub-allow-insecure-http"), "{err}");
        assert_eq!(checked_base_url("http://127.0.0.1:1234/", true).unwrap(), "http://127.0.0.1:1234");
        assert_eq!(checked_base_url("https://hub.example/", false).unwrap(), "https://hub.example");
        assert!(checked_base_url("ftp://x", true).is_err());
        assert!(checked_base_url("https://x/?a=b", false).is_err());
    }

    #[test]
    fn method_budget_follows_the_device_timeouts_bounded() {
        let m = METHOD_TIMEOUT_MARGIN;
        assert_eq!(method_budget(None, None, m), Duration::from_secs(35));
        assert_eq!(method_budget(Some(10.0), Some(20.0), m), Duration::from_secs(35));
        assert_eq!(method_budget(Some(1e9), Some(-5.0), m), Duration::from_secs(305));
    }
}
