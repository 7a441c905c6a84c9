//! The gRPC side of a stage: `Info`, `Health`, and `Forward`, whose frames go to the compute
//! thread in arrival order.

use std::sync::atomic::Ordering;

use pipeshard_wire::pb::{self, stage_server::StageServer};
use pipeshard_wire::{incoming, CheckToken, Limits};
use tokio::net::TcpListener;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status, Streaming};

use crate::{resident_bytes, Worker};

/// The `Stage` service in front of a compute thread.
pub struct StageService {
    worker: Worker,
    info: pb::StageInfo,
}

impl StageService {
    /// Serves `worker`, describing itself with `info` (its `resident_bytes` is filled per call).
    pub fn new(worker: Worker, info: pb::StageInfo) -> Self {
        Self { worker, info }
    }
}

#[tonic::async_trait]
impl pb::stage_server::Stage for StageService {
    async fn info(&self, _: Request<pb::InfoRequest>) -> Result<Response<pb::StageInfo>, Status> {
        let mut info = self.info.clone();
        info.resident_bytes = resident_bytes();
        Ok(Response::new(info))
    }

    async fn health(
        &self,
        _: Request<pb::HealthRequest>,
    ) -> Result<Response<pb::HealthReply>, Status> {
        let s = &self.worker.stats;
        Ok(Response::new(pb::HealthReply {
            steps: s.steps.load(Ordering::Relaxed),
            sequences: s.sequences.load(Ordering::Relaxed),
            kv_bytes: s.kv_bytes.load(Ordering::Relaxed),
            resident_bytes: resident_bytes(),
            busy_us: s.busy_us.load(Ordering::Relaxed),
        }))
    }

    async fn forward(
        &self,
        req: Request<Streaming<pb::Frame>>,
    ) -> Result<Response<pb::ForwardSummary>, Status> {
        let peer = req.remote_addr();
        let mut stream = req.into_inner();
        let mut frames = 0u64;
        loop {
            match stream.message().await {
                Ok(Some(frame)) => {
                    frames += 1;
                    if !self.worker.send(frame) {
                        return Err(Status::unavailable("the stage's compute thread stopped"));
                    }
                }
                Ok(None) => break,
                Err(status) => {
                    // An oversized or undecodable frame ends this stream, not the stage; a
                    // predecessor that stops ends it too.
                    if status.code() == tonic::Code::Unknown {
                        tracing::info!(?peer, %status, "the incoming link closed");
                    } else {
                        tracing::warn!(?peer, %status, "the incoming link broke");
                    }
                    return Err(status);
                }
            }
        }
        Ok(Response::new(pb::ForwardSummary { frames }))
    }
}

/// Serves `service` on `listener` until `shutdown` completes, refusing calls without `token`.
pub async fn serve_stage(
    service: StageService,
    listener: TcpListener,
    token: &str,
    limits: Limits,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), crate::StageError> {
    let server = StageServer::new(service)
        .max_decoding_message_size(limits.max_message_bytes)
        .max_encoding_message_size(limits.max_message_bytes);
    tonic::transport::Server::builder()
        .add_service(InterceptedService::new(server, CheckToken::new(token)))
        .serve_with_incoming_shutdown(incoming(listener), shutdown)
        .await?;
    Ok(())
}
