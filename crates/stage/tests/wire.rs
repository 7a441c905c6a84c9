//! A stage behind its gRPC port, fed by hand: a malformed or oversized step is refused with
//! an error that reaches the head, and the stage goes on serving; calls without the cluster
//! token are refused.

use std::time::Duration;

use pipeshard_model::{LayerRange, Stage};
use pipeshard_stage::{
    serve_stage, spawn_link, spawn_worker, LinkTarget, StageService, WorkerConfig,
};
use pipeshard_testkit::{tiny_model, Flavour, HIDDEN};
use pipeshard_wire::pb::{self, frame::Kind, head_server::HeadServer, stage_client::StageClient};
use pipeshard_wire::{encode_hidden, incoming, AddToken, Limits, WireDtype};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

const TOKEN: &str = "0123456789abcdef0123456789abcdef";

/// Collects what the last stage delivers.
struct FakeHead(mpsc::Sender<pb::Frame>);

#[tonic::async_trait]
impl pb::head_server::Head for FakeHead {
    async fn deliver(
        &self,
        req: Request<Streaming<pb::Frame>>,
    ) -> Result<Response<pb::ForwardSummary>, Status> {
        let mut s = req.into_inner();
        while let Some(f) = s.message().await? {
            let _ = self.0.send(f).await;
        }
        Ok(Response::new(pb::ForwardSummary { frames: 0 }))
    }
}

fn step(batch: u64, seq: u64, pos: u32, hidden: Option<pb::Tensor>, tokens: Vec<u32>) -> pb::Frame {
    pb::Frame {
        kind: Some(Kind::Step(pb::Step {
            batch_id: batch,
            seqs: vec![pb::SeqStep {
                seq_id: seq,
                pos,
                n: 1,
                output: pb::Output::Last as i32,
                ..Default::default()
            }],
            tokens,
            hidden,
            timings: vec![],
        })),
    }
}

async fn result(rx: &mut mpsc::Receiver<pb::Frame>) -> pb::StepResult {
    let f = tokio::time::timeout(Duration::from_secs(20), rx.recv())
        .await
        .expect("a result in time")
        .expect("the head is open");
    match f.kind {
        Some(Kind::Result(r)) => r,
        other => panic!("not a result: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_steps_are_refused_and_the_stage_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model(tmp.path(), Flavour::Llama, 4);
    let stage = Stage::load(&model, Some(LayerRange::new(3, 6))).unwrap();
    let limits = Limits {
        max_message_bytes: 64 << 10,
        ..Limits::default()
    };

    // The fake head.
    let (head_tx, mut head_rx) = mpsc::channel(16);
    let head_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let head_addr = head_listener.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(HeadServer::new(FakeHead(head_tx)))
            .serve_with_incoming(incoming(head_listener)),
    );

    // The stage, the last of its ring.
    let add = AddToken::new(TOKEN).unwrap();
    let out = spawn_link(LinkTarget::Head(head_addr.clone()), add.clone(), limits);
    let config = WorkerConfig {
        index: 1,
        wire_dtype: WireDtype::F32,
        limits,
    };
    let worker = spawn_worker(stage, config, out).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let info = pb::StageInfo::default();
    tokio::spawn(serve_stage(
        StageService::new(worker, info),
        listener,
        TOKEN,
        limits,
        std::future::pending(),
    ));

    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();

    // No token, or a wrong one: refused.
    let mut bare = StageClient::new(ch.clone());
    let err = bare.info(pb::InfoRequest {}).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    let mut wrong =
        StageClient::with_interceptor(ch.clone(), AddToken::new("fedcba9876543210fedcba").unwrap());
    let err = wrong.health(pb::HealthRequest {}).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    assert!(err.message().contains("wrong cluster token"));

    let mut client = StageClient::with_interceptor(ch.clone(), add.clone());
    let (tx, rx) = mpsc::channel(8);
    let call = {
        let mut c = client.clone();
        tokio::spawn(async move { c.forward(ReceiverStream::new(rx)).await })
    };
    let good = |seq, pos| {
        let h: Vec<f32> = (0..HIDDEN).map(|i| (i as f32 * 0.1).sin()).collect();
        step(
            7,
            seq,
            pos,
            Some(encode_hidden(&h, 1, HIDDEN, WireDtype::F32)),
            vec![],
        )
    };
    // Token ids to a later stage.
    tx.send(step(1, 1, 0, None, vec![5])).await.unwrap();
    let r = result(&mut head_rx).await;
    assert_eq!((r.batch_id, r.error_stage), (1, 1));
    assert!(r.error.contains("has none"), "{}", r.error);
    // Hidden states of the wrong width.
    let short = encode_hidden(&[0.5; 10], 1, 10, WireDtype::F32);
    tx.send(step(2, 1, 0, Some(short), vec![])).await.unwrap();
    let r = result(&mut head_rx).await;
    assert!(r.error.contains("expected [1, 64]"), "{}", r.error);
    // A position past what is cached.
    tx.send(good(1, 5)).await.unwrap();
    let r = result(&mut head_rx).await;
    assert!(r.error.contains("only 0 are cached"), "{}", r.error);
    // And a good step still works, with its timing.
    tx.send(good(1, 0)).await.unwrap();
    let r = result(&mut head_rx).await;
    assert!(r.error.is_empty(), "{}", r.error);
    assert_eq!(r.seqs.len(), 1);
    assert_eq!(r.seqs[0].tokens.len(), 1);
    assert_eq!(r.timings.len(), 1);

    // An oversized message ends that stream only.
    let huge = encode_hidden(
        &vec![0.0; 32 * HIDDEN * 16],
        32 * 16,
        HIDDEN,
        WireDtype::F32,
    );
    tx.send(step(3, 2, 0, Some(huge), vec![])).await.unwrap();
    let err = call.await.unwrap().unwrap_err();
    assert!(
        matches!(
            err.code(),
            tonic::Code::OutOfRange | tonic::Code::ResourceExhausted | tonic::Code::Internal
        ),
        "{err:?}"
    );
    let (tx, rx) = mpsc::channel(8);
    let call = tokio::spawn(async move { client.forward(ReceiverStream::new(rx)).await });
    tx.send(good(2, 0)).await.unwrap();
    let r = result(&mut head_rx).await;
    assert!(r.error.is_empty(), "{}", r.error);
    drop(tx);
    assert_eq!(call.await.unwrap().unwrap().into_inner().frames, 1);
}
