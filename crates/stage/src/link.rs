//! The outgoing link: one long-lived client stream to the successor (a stage's `Forward`, or
//! the head's `Deliver`), fed from a channel. A broken stream is reconnected; frames that were
//! on it are lost, and the head notices by the health check or the step's deadline.

use std::time::Duration;

use pipeshard_wire::pb::{self, head_client::HeadClient, stage_client::StageClient};
use pipeshard_wire::{AddToken, Limits};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

/// Where a link sends its frames.
#[derive(Debug, Clone)]
pub enum LinkTarget {
    /// The next stage's `Forward`.
    Stage(String),
    /// The head's `Deliver`.
    Head(String),
}

impl LinkTarget {
    /// The address.
    pub fn addr(&self) -> &str {
        match self {
            Self::Stage(a) | Self::Head(a) => a,
        }
    }
}

/// A stage client that adds the cluster token.
pub type AuthStageClient = StageClient<InterceptedService<Channel, AddToken>>;

/// Connects to a stage at `addr` (`host:port`).
pub async fn connect(
    addr: &str,
    token: &AddToken,
    limits: &Limits,
) -> Result<AuthStageClient, tonic::transport::Error> {
    let ch = endpoint(addr)?.connect().await?;
    Ok(StageClient::with_interceptor(ch, token.clone())
        .max_decoding_message_size(limits.max_message_bytes)
        .max_encoding_message_size(limits.max_message_bytes))
}

fn endpoint(addr: &str) -> Result<Endpoint, tonic::transport::Error> {
    Ok(Endpoint::from_shared(format!("http://{addr}"))?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(5)))
}

/// Starts the task that sends the frames put on the returned channel to `target`, in order.
pub fn spawn_link(target: LinkTarget, token: AddToken, limits: Limits) -> mpsc::Sender<pb::Frame> {
    let (tx, mut rx) = mpsc::channel::<pb::Frame>(256);
    tokio::spawn(async move {
        let mut pending: Option<pb::Frame> = None;
        let mut backoff = Duration::from_millis(50);
        loop {
            if pending.is_none() {
                match rx.recv().await {
                    Some(f) => pending = Some(f),
                    None => return,
                }
            }
            let ch = match endpoint(target.addr()) {
                Ok(e) => e.connect().await,
                Err(e) => Err(e),
            };
            let ch = match ch {
                Ok(ch) => ch,
                Err(e) => {
                    tracing::warn!(target = target.addr(), error = %e, "cannot reach the next node; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    continue;
                }
            };
            backoff = Duration::from_millis(50);
            let (stream_tx, stream_rx) = mpsc::channel::<pb::Frame>(64);
            let stream = ReceiverStream::new(stream_rx);
            let call = {
                let token = token.clone();
                let target = target.clone();
                tokio::spawn(async move {
                    let r = match &target {
                        LinkTarget::Stage(_) => StageClient::with_interceptor(ch, token)
                            .max_encoding_message_size(limits.max_message_bytes)
                            .forward(stream)
                            .await
                            .map(|_| ()),
                        LinkTarget::Head(_) => HeadClient::with_interceptor(ch, token)
                            .max_encoding_message_size(limits.max_message_bytes)
                            .deliver(stream)
                            .await
                            .map(|_| ()),
                    };
                    if let Err(status) = r {
                        tracing::warn!(target = target.addr(), %status, "the link to the next node broke");
                    }
                })
            };
            // Feed the stream until the call ends or our input closes.
            loop {
                let Some(f) = pending.take() else {
                    match rx.recv().await {
                        Some(f) => {
                            pending = Some(f);
                            continue;
                        }
                        None => {
                            drop(stream_tx);
                            let _ = call.await;
                            return;
                        }
                    }
                };
                if let Err(e) = stream_tx.send(f).await {
                    // The call ended: send this frame on the next connection.
                    pending = Some(e.0);
                    break;
                }
            }
            let _ = call.await;
        }
    });
    tx
}
