//! The background refresher: prefetched identities issued, certificates renewed
//! at half their lifetime, failures retried with backoff, expired certificates
//! dropped.

use std::{
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use super::{CertManager, Slot, SlotState, rfc3339};
use crate::identity::{Error, SpiffeId};

/// Background retries after a failure: the first after this long, doubling.
const RETRY_MIN: Duration = Duration::from_secs(1);
/// The longest wait between background retries.
const RETRY_MAX: Duration = Duration::from_secs(15);
/// The refresher looks at the certificates at least this often.
const REFRESH_MAX_SLEEP: Duration = Duration::from_secs(30);

/// The last failed issuance, while no later one succeeded.
pub(super) struct Failure {
    /// Its error, as text.
    pub(super) reason: String,
    /// When it failed.
    pub(super) at: Instant,
    /// Consecutive failures.
    pub(super) count: u32,
}

impl Failure {
    /// When the background retry is due: [`RETRY_MIN`] after the first failure,
    /// doubling per further one, at most [`RETRY_MAX`].
    pub(super) fn retry_at(&self) -> Instant {
        let exp = self.count.saturating_sub(1).min(16);
        self.at + (RETRY_MIN * 2u32.pow(exp)).min(RETRY_MAX)
    }

    /// The error a request for `id` gets while this failure holds.
    pub(super) fn unavailable(&self, id: &SpiffeId) -> Error {
        Error::Unavailable {
            id: id.to_string(),
            ago_ms: self.at.elapsed().as_millis(),
            reason: self.reason.clone(),
        }
    }
}

impl SlotState {
    /// How long until the refresher should issue again (zero: now).
    pub(super) fn due_in(&self) -> Duration {
        match (&self.current, &self.failure) {
            (_, Some(failure)) => failure.retry_at().saturating_duration_since(Instant::now()),
            (Some(current), None) => current
                .renew_at
                .duration_since(SystemTime::now())
                .unwrap_or_default(),
            (None, None) => Duration::ZERO,
        }
    }
}

impl CertManager {
    /// The background refresher: issues prefetched identities, renews
    /// certificates past half their lifetime, retries failures with backoff, and
    /// drops expired certificates.
    pub(super) async fn refresh(&self) {
        loop {
            let mut sleep = REFRESH_MAX_SLEEP;
            let mut due = Vec::new();
            for slot in self.inner.snapshot() {
                let mut state = slot.state.lock().expect("certificate slot lock");
                if let Some(current) = &state.current {
                    match current.not_after.duration_since(SystemTime::now()) {
                        Ok(left) => sleep = sleep.min(left),
                        Err(_) => {
                            tracing::error!(
                                "the workload certificate of {} expired at {} and could not be renewed; connections needing it fail until a new one is issued{}",
                                slot.id,
                                rfc3339(current.not_after),
                                state
                                    .failure
                                    .as_ref()
                                    .map(|f| format!(" (last error: {})", f.reason))
                                    .unwrap_or_default()
                            );
                            state.current = None;
                        }
                    }
                }
                let due_in = state.due_in();
                if due_in.is_zero() {
                    due.push(slot.clone());
                } else {
                    sleep = sleep.min(due_in);
                }
            }
            if due.is_empty() {
                tokio::select! {
                    () = tokio::time::sleep(sleep) => {}
                    () = self.inner.wake.notified() => {}
                }
                continue;
            }
            let mut renewals = tokio::task::JoinSet::new();
            for slot in due {
                let this = self.clone();
                renewals.spawn(async move { this.renew(&slot).await });
            }
            while renewals.join_next().await.is_some() {}
        }
    }

    /// Issues a certificate for `slot` if it is (still) due; logs a failure.
    async fn renew(&self, slot: &Arc<Slot>) {
        let _issuing = slot.issuing.lock().await;
        let previous = {
            let state = slot.state.lock().expect("certificate slot lock");
            if !state.due_in().is_zero() {
                return;
            }
            state.current.clone()
        };
        if let Err(e) = self.inner.issue(slot).await {
            let (count, retry_in) = {
                let state = slot.state.lock().expect("certificate slot lock");
                let failure = state.failure.as_ref().expect("a failure was recorded");
                (
                    failure.count,
                    failure.retry_at().saturating_duration_since(Instant::now()),
                )
            };
            match previous.filter(|p| SystemTime::now() < p.not_after) {
                Some(previous) => tracing::warn!(
                    "renewing the workload certificate of {} failed ({count} in a row); keeping the current one, valid until {}; retrying in {:.1} s: {e}",
                    slot.id,
                    rfc3339(previous.not_after),
                    retry_in.as_secs_f64(),
                ),
                None => tracing::warn!(
                    "issuing the workload certificate of {} failed ({count} in a row); retrying in {:.1} s: {e}",
                    slot.id,
                    retry_in.as_secs_f64(),
                ),
            }
        }
    }
}
