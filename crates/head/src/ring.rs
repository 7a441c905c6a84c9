//! The head's view of the ring: connecting to the remote stages, checking that they are one
//! model's layers in order, receiving the last stage's results, and watching the stages'
//! health so that a dead stage turns into clear errors rather than hung requests.

use std::time::Duration;

use std::sync::atomic::Ordering;

use pipeshard_stage::{connect, AuthStageClient, WorkerStats};
use pipeshard_wire::pb::{self, head_server::HeadServer};
use pipeshard_wire::{incoming, AddToken, CheckToken, Limits};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status, Streaming};

use crate::{short, HeadError};

/// A remote stage the head has connected to.
pub(crate) struct RemoteStage {
    /// Position in the ring (1..).
    pub position: usize,
    /// `host:port`.
    pub addr: String,
    pub client: AuthStageClient,
    pub info: pb::StageInfo,
}

impl RemoteStage {
    pub fn describe(&self) -> String {
        format!("stage {} at {}", self.position, self.addr)
    }
}

/// Connects to every remote stage and asks for its `Info`.
pub(crate) async fn connect_all(
    addrs: &[String],
    token: &AddToken,
    limits: &Limits,
) -> Result<Vec<RemoteStage>, HeadError> {
    let mut out = Vec::new();
    for (i, addr) in addrs.iter().enumerate() {
        let position = i + 1;
        let mut client = connect(addr, token, limits).await.map_err(|e| {
            HeadError::Ring(format!(
                "stage {position} at {addr} is unreachable: {}",
                source_chain(&e)
            ))
        })?;
        let info = client
            .info(pb::InfoRequest {})
            .await
            .map_err(|s| {
                HeadError::Ring(format!(
                    "stage {position} at {addr} {}",
                    describe_status(&s)
                ))
            })?
            .into_inner();
        out.push(RemoteStage {
            position,
            addr: addr.clone(),
            client,
            info,
        });
    }
    Ok(out)
}

fn describe_status(s: &Status) -> String {
    match s.code() {
        tonic::Code::Unauthenticated => format!(
            "refused the head's cluster token ({}); give every node the same --token-file",
            s.message()
        ),
        _ => format!("did not answer Info: {}", s.message()),
    }
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Checks that the stages, in ring order (each with a description for messages), come from
/// one model and that their layer ranges tile `0..n_layers` with no gap or overlap.
pub fn check_ring(stages: &[(String, pb::StageInfo)]) -> Result<(), String> {
    let Some((first_name, first)) = stages.first() else {
        return Err("the ring has no stages".into());
    };
    for (name, info) in stages {
        if info.model_sha256 != first.model_sha256 {
            return Err(format!(
                "{name} holds a shard of another model (source sha256 {}…), while {first_name} holds {}…",
                short(&info.model_sha256),
                short(&first.model_sha256)
            ));
        }
        if info.n_layers != first.n_layers {
            return Err(format!(
                "{name} belongs to a model of {} layers, {first_name} to one of {}",
                info.n_layers, first.n_layers
            ));
        }
    }
    let mut expected = 0u32;
    for (pos, (name, info)) in stages.iter().enumerate() {
        let order_hint = if info.stage_index as usize != pos {
            format!(
                " (it is stage {} of its split; list the stages in ring order)",
                info.stage_index
            )
        } else {
            String::new()
        };
        if info.layer_start > expected {
            return Err(format!(
                "gap in the ring: layers {expected}..{} are held by no stage; {name} starts at layer {}{order_hint}",
                info.layer_start, info.layer_start
            ));
        }
        if info.layer_start < expected {
            return Err(format!(
                "overlap in the ring: {name} holds layers {}..{}, but the stages before it already hold up to layer {expected}{order_hint}",
                info.layer_start, info.layer_end
            ));
        }
        expected = info.layer_end;
    }
    if expected != first.n_layers {
        return Err(format!(
            "the ring ends at layer {expected}: layers {expected}..{} are held by no stage",
            first.n_layers
        ));
    }
    Ok(())
}

/// Health of one stage.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StageStatus {
    /// Which stage, where.
    pub name: String,
    /// Layers held.
    pub layers: String,
    /// Answering now.
    pub up: bool,
    /// Resident memory of the stage's process, bytes (as last reported; stage 0 shares the
    /// head's process).
    pub resident_bytes: u64,
    /// Sequences with a KV cache there.
    pub sequences: u64,
    /// Microseconds spent computing since the stage started.
    pub busy_us: u64,
    /// Bytes the stage may spend on KV caches.
    pub kv_budget_bytes: u64,
    /// KV bytes per token position there.
    pub kv_bytes_per_token: u64,
}

/// The ring's state.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RingStatus {
    /// Every stage is answering: requests are accepted.
    pub ready: bool,
    /// Why not, when not.
    pub message: String,
    /// Each stage.
    pub stages: Vec<StageStatus>,
}

impl RingStatus {
    pub(crate) fn up(stages: &[(String, pb::StageInfo)]) -> Self {
        Self {
            ready: true,
            message: String::new(),
            stages: stages
                .iter()
                .map(|(name, i)| StageStatus {
                    name: name.clone(),
                    layers: format!("{}..{}", i.layer_start, i.layer_end),
                    up: true,
                    resident_bytes: i.resident_bytes,
                    sequences: 0,
                    busy_us: 0,
                    kv_budget_bytes: i.kv_budget_bytes,
                    kv_bytes_per_token: i.kv_bytes_per_token,
                })
                .collect(),
        }
    }
}

/// Polls every remote stage's `Health`; marks the ring down while one does not answer, and up
/// again once every stage answers and still passes the ring check.
pub(crate) fn spawn_health(
    mut remotes: Vec<RemoteStage>,
    infos: Vec<(String, pb::StageInfo)>,
    local: std::sync::Arc<WorkerStats>,
    status: watch::Sender<RingStatus>,
    every: Duration,
) {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            let mut next = status.borrow().clone();
            next.stages[0].sequences = local.sequences.load(Ordering::Relaxed);
            next.stages[0].busy_us = local.busy_us.load(Ordering::Relaxed);
            next.stages[0].resident_bytes = pipeshard_stage::resident_bytes();
            let mut down = None;
            for r in &mut remotes {
                let reply = tokio::time::timeout(
                    every.max(Duration::from_secs(2)),
                    r.client.health(pb::HealthRequest {}),
                )
                .await;
                let entry = &mut next.stages[r.position];
                match reply {
                    Ok(Ok(h)) => {
                        let h = h.into_inner();
                        entry.up = true;
                        entry.resident_bytes = h.resident_bytes;
                        entry.sequences = h.sequences;
                        entry.busy_us = h.busy_us;
                    }
                    Ok(Err(s)) => {
                        entry.up = false;
                        down.get_or_insert(format!(
                            "{} failed its health check: {}",
                            r.describe(),
                            s.message()
                        ));
                    }
                    Err(_) => {
                        entry.up = false;
                        down.get_or_insert(format!("{} stopped responding", r.describe()));
                    }
                }
            }
            match down {
                Some(msg) => {
                    if next.ready {
                        tracing::error!("{msg}");
                    }
                    next.ready = false;
                    next.message = msg;
                }
                None if !next.ready => {
                    // Back: it may be a restarted process, so check who it is again.
                    let mut fresh = infos.clone();
                    let mut failed = None;
                    for r in &mut remotes {
                        match r.client.info(pb::InfoRequest {}).await {
                            Ok(i) => fresh[r.position].1 = i.into_inner(),
                            Err(s) => {
                                failed = Some(format!("{} {}", r.describe(), describe_status(&s)))
                            }
                        }
                    }
                    match failed.map_or_else(|| check_ring(&fresh), Err) {
                        Ok(()) => {
                            tracing::info!("every stage answers again; serving");
                            next.ready = true;
                            next.message.clear();
                        }
                        Err(msg) => next.message = msg,
                    }
                }
                None => {}
            }
            if status.is_closed() {
                return;
            }
            status.send_if_modified(|cur| {
                let changed = *cur != next;
                *cur = next;
                changed
            });
        }
    });
}

/// The `Head` service: the last stage's frames go to the scheduler.
struct HeadService {
    results: mpsc::Sender<pb::Frame>,
}

#[tonic::async_trait]
impl pb::head_server::Head for HeadService {
    async fn deliver(
        &self,
        req: Request<Streaming<pb::Frame>>,
    ) -> Result<Response<pb::ForwardSummary>, Status> {
        let mut stream = req.into_inner();
        let mut frames = 0;
        while let Some(frame) = stream.message().await? {
            frames += 1;
            if self.results.send(frame).await.is_err() {
                return Err(Status::unavailable("the head is shutting down"));
            }
        }
        Ok(Response::new(pb::ForwardSummary { frames }))
    }
}

/// Serves `Head.Deliver` on `listener` in the background.
pub(crate) fn serve_deliver(
    listener: TcpListener,
    token: &str,
    limits: Limits,
    results: mpsc::Sender<pb::Frame>,
) {
    let server = HeadServer::new(HeadService { results })
        .max_decoding_message_size(limits.max_message_bytes);
    let svc = InterceptedService::new(server, CheckToken::new(token));
    tokio::spawn(async move {
        if let Err(e) = tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(incoming(listener))
            .await
        {
            tracing::error!(error = %e, "the ring listener failed");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(sha: &str, index: u32, start: u32, end: u32) -> (String, pb::StageInfo) {
        (
            format!("stage {index}"),
            pb::StageInfo {
                model_sha256: sha.into(),
                stage_index: index,
                layer_start: start,
                layer_end: end,
                n_layers: 6,
                ..Default::default()
            },
        )
    }

    #[test]
    fn a_tiling_ring_of_one_model_passes() {
        check_ring(&[info("a", 0, 0, 2), info("a", 1, 2, 4), info("a", 2, 4, 6)]).unwrap();
    }

    #[test]
    fn gaps_overlaps_order_and_mixed_models_are_named() {
        let e = check_ring(&[info("a", 0, 0, 2), info("a", 2, 4, 6)]).unwrap_err();
        assert!(e.contains("gap") && e.contains("layers 2..4"), "{e}");
        let e = check_ring(&[info("a", 0, 0, 3), info("a", 1, 2, 6)]).unwrap_err();
        assert!(e.contains("overlap") && e.contains("stage 1"), "{e}");
        let e =
            check_ring(&[info("a", 0, 0, 2), info("a", 2, 4, 6), info("a", 1, 2, 4)]).unwrap_err();
        assert!(e.contains("ring order"), "{e}");
        let e = check_ring(&[info("a", 0, 0, 2), info("b", 1, 2, 6)]).unwrap_err();
        assert!(e.contains("another model") && e.contains("stage 1"), "{e}");
        let e = check_ring(&[info("a", 0, 0, 2), info("a", 1, 2, 4)]).unwrap_err();
        assert!(e.contains("layers 4..6 are held by no stage"), "{e}");
    }
}
