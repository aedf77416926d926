//! Operations: Prometheus metrics, readiness, the access log and run-time log
//! levels.
//!
//! * [`metrics`]: Istio's standard TCP metrics (`istio_tcp_*`, with Istio's labels)
//!   and podlink's own (`podlink_*`), in the OpenMetrics text format on
//!   `:15020/metrics`.
//! * [`scrape`]: the `podlink_*` metrics read at scrape time, from the proxy's
//!   state and the dataplane's maps.
//! * [`connection`]: what each proxied connection records — the metrics as it opens,
//!   moves bytes and closes, and one access log line when it is done.
//! * [`logging`]: the log subscriber (text or JSON lines) and its filter, which the
//!   admin endpoint's `/logging` changes at run time.
//! * [`server`]: the HTTP listeners of the metrics (`:15020`) and readiness
//!   (`:15021/healthz/ready`) endpoints.
//!
//! Ports, paths, metric names and labels are Istio's and ztunnel's, so that
//! dashboards and probes written for them work unchanged
//! (<https://istio.io/latest/docs/reference/config/metrics/>).

pub mod connection;
pub mod logging;
pub mod metrics;
pub mod scrape;
pub mod server;
