//! The distributed commands: `stage` (one shard behind a gRPC port), `serve` (the head: stage 0,
//! the scheduler and the OpenAI API), and `up` (everything on this machine, one process per
//! stage on loopback).

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use pipeshard_api::ApiConfig;
use pipeshard_generate::{ChatMessage, SamplingParams, TextModel};
use pipeshard_head::{GenEvent, GenRequest, HeadConfig, HeadHandle, LocalStage, ServedModel};
use pipeshard_model::gguf::GgufFile;
use pipeshard_model::Stage;
use pipeshard_shard::{Manifest, ModelSource, ShardIdentity};
use pipeshard_stage::{
    serve_stage, spawn_link, spawn_worker, stage_info, LinkTarget, StageIdentity, StageService,
    WorkerConfig,
};
use pipeshard_wire::{read_token_file, AddToken, Limits, WireDtype};
use tokio::net::TcpListener;

use crate::cmd::DEFAULT_MODEL;
use crate::spec::DraftArgs;

/// Knobs of every ring link.
#[derive(Args, Debug, Clone)]
pub struct LinkArgs {
    /// File holding the cluster token (the same on every node).
    #[arg(long, env = "PIPESHARD_TOKEN_FILE")]
    pub token_file: PathBuf,
    /// Element type of hidden states sent on: f32 (exact), f16 or bf16 (half the bytes).
    #[arg(long, default_value = "f32")]
    pub wire_dtype: WireDtype,
    /// Largest message accepted or sent, MiB.
    #[arg(long, default_value_t = 64)]
    pub max_message_mib: usize,
    /// Most token rows in one step.
    #[arg(long, default_value_t = 4096)]
    pub max_step_tokens: usize,
    /// Most sequences in one step.
    #[arg(long, default_value_t = 256)]
    pub max_step_seqs: usize,
}

impl LinkArgs {
    fn limits(&self) -> Limits {
        Limits {
            max_message_bytes: self.max_message_mib << 20,
            max_tokens_per_step: self.max_step_tokens,
            max_seqs_per_step: self.max_step_seqs,
        }
    }
}

#[derive(Args, Debug)]
pub struct StageArgs {
    /// The shard this stage serves (written by `pipeshard split`).
    #[arg(long)]
    pub shard: PathBuf,
    /// Address to listen on for the previous node's frames.
    #[arg(long, default_value = "0.0.0.0:7001")]
    pub listen: String,
    /// The next node: the next stage, or the head's ring address for the last stage.
    #[arg(long)]
    pub next: String,
    #[command(flatten)]
    pub link: LinkArgs,
    /// Compute threads.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Pin this process to one CPU core.
    #[arg(long)]
    pub cpu: Option<usize>,
    /// KV cache budget, KiB (default: 80% of the memory available at start).
    #[arg(long)]
    pub kv_budget_kib: Option<u64>,
}

pub(crate) fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

pub(crate) fn pin(cpu: usize) -> Result<()> {
    let ok = core_affinity::set_for_current(core_affinity::CoreId { id: cpu });
    if !ok {
        bail!("cannot pin to CPU core {cpu}");
    }
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(t) => t,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

pub fn stage(a: StageArgs) -> Result<()> {
    if let Some(c) = a.cpu {
        pin(c)?;
    }
    let token = read_token_file(&a.link.token_file)?;
    let id = ShardIdentity::read(&a.shard)?;
    let mut stage = Stage::load(&a.shard, None)?;
    stage.set_threads(a.threads)?;
    let identity = StageIdentity {
        index: id.index,
        count: id.count,
        model_sha256: id.source_sha256,
    };
    let limits = a.link.limits();
    let rt = runtime()?;
    rt.block_on(async move {
        let listener = TcpListener::bind(&a.listen)
            .await
            .with_context(|| format!("listening on {}", a.listen))?;
        let addr = listener.local_addr()?;
        let target = if stage.is_last() {
            LinkTarget::Head(a.next.clone())
        } else {
            LinkTarget::Stage(a.next.clone())
        };
        let budget = pipeshard_stage::kv_budget(a.kv_budget_kib);
        let info = stage_info(&stage, &identity, a.link.wire_dtype, &a.next, budget);
        eprintln!(
            "stage {} of {}: layers {}..{} of {}, {} MB of weights, sending to {}",
            identity.index,
            identity.count,
            info.layer_start,
            info.layer_end,
            info.n_layers,
            info.weight_bytes / 1_000_000,
            a.next
        );
        let out = spawn_link(target, AddToken::new(&token)?, limits);
        let worker = spawn_worker(
            stage,
            WorkerConfig {
                index: identity.index,
                wire_dtype: a.link.wire_dtype,
                limits,
            },
            out,
        )?;
        // `up` reads this line to learn the port.
        println!("listening on {addr}");
        std::io::stdout().flush()?;
        serve_stage(
            StageService::new(worker, info),
            listener,
            &token,
            limits,
            shutdown_signal(),
        )
        .await?;
        eprintln!("stage {}: stopped", identity.index);
        Ok(())
    })
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// The manifest written by `pipeshard split` (stage 0 runs in this process).
    #[arg(long)]
    pub manifest: PathBuf,
    /// The remote stages 1.., in ring order (`host:port`, repeated).
    #[arg(long = "stage")]
    pub stages: Vec<String>,
    /// Address of the HTTP API.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// Address where the last stage delivers results.
    #[arg(long, default_value = "0.0.0.0:7000")]
    pub ring_listen: String,
    #[command(flatten)]
    pub link: LinkArgs,
    #[command(flatten)]
    pub head: HeadArgs,
}

/// How the head batches users' work into steps.
#[derive(Args, Debug, Clone, Copy)]
pub struct BatchArgs {
    /// Micro-batch groups cycling through the ring (0: one per stage).
    #[arg(long, default_value_t = 0)]
    pub groups: usize,
    /// Longest prompt chunk in one step; a longer prompt's chunks follow each other through
    /// the stages.
    #[arg(long, default_value_t = HeadConfig::default().prefill_chunk)]
    pub prefill_chunk: usize,
}

impl Default for BatchArgs {
    fn default() -> Self {
        Self {
            groups: 0,
            prefill_chunk: HeadConfig::default().prefill_chunk,
        }
    }
}

/// Knobs of the head.
#[derive(Args, Debug, Clone)]
pub struct HeadArgs {
    /// The model name clients use (default: the model file's name without `.gguf`).
    #[arg(long)]
    pub model_name: Option<String>,
    /// Compute threads of the local stage 0.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Largest HTTP request body, KiB.
    #[arg(long, default_value_t = 1024)]
    pub max_body_kib: usize,
    /// Seconds a step may take round the ring before its requests fail.
    #[arg(long, default_value_t = 300)]
    pub step_timeout_s: u64,
    #[command(flatten)]
    pub batch: BatchArgs,
    /// KV cache budget of stage 0, KiB (default: 80% of the memory available at start).
    #[arg(long)]
    pub kv_budget_kib: Option<u64>,
    /// Requests that may wait for KV room; beyond, new ones get 429.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    #[command(flatten)]
    pub draft: DraftArgs,
}

/// Loads stage 0 of a manifest and the text model; checks the shard against the manifest.
pub(crate) fn load_head_side(
    manifest_path: &Path,
    threads: usize,
    name: Option<String>,
    draft: &DraftArgs,
) -> Result<(LocalStage, ServedModel, Manifest)> {
    let manifest = Manifest::load(manifest_path)?;
    let entry = &manifest.stages[0];
    manifest.verify_stage(manifest_path, entry, false, true)?;
    let path = Manifest::stage_path(manifest_path, entry);
    let meta = GgufFile::open(&path)?;
    let text = TextModel::from_gguf(&meta.content)?;
    let mut stage = Stage::load(&path, Some(entry.layers))?;
    stage.set_threads(threads)?;
    let ctx_len = stage.config().ctx_len;
    let name = name.unwrap_or_else(|| manifest.model.file.trim_end_matches(".gguf").to_string());
    let local = LocalStage {
        drafter: draft.load(&text.tokenizer, threads)?,
        stage,
        identity: StageIdentity {
            index: 0,
            count: manifest.stages.len(),
            model_sha256: manifest.model.sha256.clone(),
        },
    };
    let model = ServedModel {
        name,
        text,
        ctx_len,
        sha256: manifest.model.sha256.clone(),
    };
    Ok((local, model, manifest))
}

pub(crate) fn head_config(
    link: &LinkArgs,
    head: &HeadArgs,
    remote: Vec<String>,
    token: String,
) -> HeadConfig {
    HeadConfig {
        remote,
        token,
        limits: link.limits(),
        wire_dtype: link.wire_dtype,
        prefill_chunk: head.batch.prefill_chunk,
        step_timeout: Duration::from_secs(head.step_timeout_s),
        groups: head.batch.groups,
        kv_budget_bytes: pipeshard_stage::kv_budget(head.kv_budget_kib),
        max_queue: head.max_queue,
        draft_k: head.draft.fixed_k().unwrap_or(None),
        draft_max: head.draft.draft_max,
        ..HeadConfig::default()
    }
}

async fn serve_api(head: HeadHandle, listener: TcpListener, max_body: usize) -> Result<()> {
    let app = pipeshard_api::router(
        head,
        ApiConfig {
            max_body_bytes: max_body,
        },
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await
        .context("serving the API")
}

pub fn serve(a: ServeArgs) -> Result<()> {
    let token = read_token_file(&a.link.token_file)?;
    let (local, model, manifest) = load_head_side(
        &a.manifest,
        a.head.threads,
        a.head.model_name.clone(),
        &a.head.draft,
    )?;
    let want = manifest.stages.len() - 1;
    if a.stages.len() != want {
        bail!(
            "the manifest has {} stages: give --stage for each of stages 1..{} ({want} addresses), not {}",
            manifest.stages.len(),
            manifest.stages.len() - 1,
            a.stages.len()
        );
    }
    let config = head_config(&a.link, &a.head, a.stages.clone(), token);
    runtime()?.block_on(async move {
        let ring = TcpListener::bind(&a.ring_listen)
            .await
            .with_context(|| format!("listening on {}", a.ring_listen))?;
        let head = pipeshard_head::start(local, model, ring, config).await?;
        let api = TcpListener::bind(&a.listen)
            .await
            .with_context(|| format!("listening on {}", a.listen))?;
        let addr = api.local_addr()?;
        println!("serving {} at http://{addr}/v1", head.model().name);
        std::io::stdout().flush()?;
        serve_api(head, api, a.head.max_body_kib << 10).await
    })
}

#[derive(Args, Debug)]
pub struct UpArgs {
    /// A known model name, a GGUF file or a manifest.
    #[arg(long, default_value = DEFAULT_MODEL)]
    pub model: String,
    /// Number of stages (one process each; stage 0 runs in this one), layers split to balance
    /// their cost (as `split --stages`).
    #[arg(long, default_value_t = 3)]
    pub stages: usize,
    /// Explicit layer ranges instead, e.g. `0..16,16..28` (the last stage also runs the
    /// lm_head, so it may want fewer layers).
    #[arg(long)]
    pub layers: Option<String>,
    /// HTTP port of the API (0: any free port).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Address of the API.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Run one request through the ring, print it and exit.
    #[arg(long)]
    pub prompt: Option<String>,
    /// With --prompt: render it with the chat template.
    #[arg(long)]
    pub chat: bool,
    /// With --prompt: tokens to generate.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// With --prompt: sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// With --prompt: seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// With --prompt: print the result as JSON.
    #[arg(long)]
    pub json: bool,
    /// Compute threads per stage.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Pin each stage to its own core: auto (when there are enough cores), on, off.
    #[arg(long, default_value = "auto")]
    pub pin: String,
    /// Element type of hidden states between stages.
    #[arg(long, default_value = "f32")]
    pub wire_dtype: WireDtype,
    /// The model name clients use (default: the known model's name, or the file's).
    #[arg(long)]
    pub model_name: Option<String>,
    #[command(flatten)]
    pub batch: BatchArgs,
    #[command(flatten)]
    pub draft: DraftArgs,
}

/// Stage processes started by `up`; stopped (SIGTERM, then SIGKILL) when dropped.
pub(crate) struct Children(pub Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        // In ring order (they were started last to first), each after its predecessor.
        for c in self.0.iter_mut().rev() {
            #[cfg(unix)]
            // SAFETY: kill(2) on a child's pid that we have not yet reaped.
            unsafe {
                libc::kill(c.id() as libc::pid_t, libc::SIGTERM);
            }
            let deadline = std::time::Instant::now() + Duration::from_secs(3);
            while std::time::Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Splits the model into `n` stages under the cache (once), returning the manifest's path.
pub(crate) fn ensure_split(model: &str, n: usize, layers: Option<&str>) -> Result<PathBuf> {
    let source = ModelSource::resolve(model, false)?;
    let gguf = match source {
        ModelSource::Manifest { path, manifest } => {
            if manifest.stages.len() != n || layers.is_some() {
                bail!(
                    "{} is already split into {} stages; give the model itself to split it otherwise",
                    path.display(),
                    manifest.stages.len()
                );
            }
            return Ok(path);
        }
        ModelSource::Gguf(p) => p,
    };
    let g = GgufFile::open(&gguf)?;
    let c = pipeshard_model::ModelConfig::from_gguf(&g.content)?;
    let ranges = match layers {
        Some(spec) => {
            let r = pipeshard_shard::parse_layers(spec)?;
            pipeshard_model::LayerRange::check_tiling(&r, c.n_layers)?;
            r
        }
        None => pipeshard_shard::plan(&g.content, c.n_layers, n)?,
    };
    let stem = gguf
        .file_stem()
        .map(|s| s.to_string_lossy().to_string())
        .unwrap_or_else(|| "model".into());
    let bounds: Vec<String> = ranges.iter().map(|r| r.end.to_string()).collect();
    let dir = pipeshard_shard::cache_dir()
        .join("shards")
        .join(format!("{stem}-{}", bounds.join("_")));
    let manifest_path = dir.join("manifest.json");
    let size = std::fs::metadata(&gguf)?.len();
    if let Ok(m) = Manifest::load(&manifest_path) {
        let same = m.stages.iter().map(|s| s.layers).eq(ranges.iter().copied());
        if m.model.bytes == size && same && m.verify(&manifest_path, false, true).is_ok() {
            return Ok(manifest_path);
        }
    }
    eprintln!(
        "splitting {} into {} stages ({}) in {}",
        gguf.display(),
        ranges.len(),
        ranges
            .iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(", "),
        dir.display()
    );
    pipeshard_shard::split(&gguf, &ranges, &dir, false)?;
    Ok(manifest_path)
}

/// Writes a fresh random cluster token, readable only by this user.
pub(crate) fn write_token(path: &Path) -> Result<()> {
    use rand::Rng;
    let mut rng = rand::rng();
    let token: String = (0..32)
        .map(|_| char::from_digit(rng.random_range(0..16), 16).unwrap_or('0'))
        .collect();
    std::fs::write(path, format!("{token}\n"))
        .with_context(|| format!("writing {}", path.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    }
    Ok(())
}

/// Starts one stage process and waits for the port it listens on.
pub(crate) fn spawn_stage(
    shard: &Path,
    next: &str,
    token_file: &Path,
    threads: usize,
    cpu: Option<usize>,
    wire: WireDtype,
    kv_budget_kib: u64,
) -> Result<(Child, String)> {
    let exe = std::env::current_exe().context("finding the pipeshard binary")?;
    let mut cmd = Command::new(exe);
    cmd.arg("stage")
        .args(["--kv-budget-kib", &kv_budget_kib.to_string()])
        .arg("--shard")
        .arg(shard)
        .args(["--listen", "127.0.0.1:0", "--next", next])
        .arg("--token-file")
        .arg(token_file)
        .args(["--threads", &threads.to_string()])
        .args([
            "--wire-dtype",
            match wire {
                WireDtype::F32 => "f32",
                WireDtype::F16 => "f16",
                WireDtype::Bf16 => "bf16",
            },
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if let Some(c) = cpu {
        cmd.args(["--cpu", &c.to_string()]);
    }
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl is async-signal-safe; it asks the kernel to stop the stage when
        // this process dies, so no stage outlives `up`.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
    }
    let mut child = cmd.spawn().context("starting a stage process")?;
    let stdout = child.stdout.take().context("the stage's stdout")?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    let Some(addr) = line.trim().strip_prefix("listening on ") else {
        let _ = child.kill();
        let status = child.wait()?;
        bail!(
            "the stage for {} did not start ({status}); see its messages above",
            shard.display()
        );
    };
    Ok((child, addr.to_string()))
}

/// A ring on this machine: stage processes 1.. started, stage 0 and the head's side loaded.
pub(crate) struct LocalRing {
    /// The stage processes (stopped when dropped).
    pub children: Children,
    /// Stage 0, for the head's process.
    pub local: LocalStage,
    /// The model served.
    pub model: ServedModel,
    /// The head's configuration (remote stages, token).
    pub config: HeadConfig,
    /// Where the last stage delivers.
    pub ring: std::net::TcpListener,
}

impl LocalRing {
    /// Starts the head on this ring (inside a runtime).
    pub async fn start_head(self) -> Result<(HeadHandle, Children)> {
        self.ring.set_nonblocking(true)?;
        let ring = TcpListener::from_std(self.ring)?;
        let head = pipeshard_head::start(self.local, self.model, ring, self.config).await?;
        Ok((head, self.children))
    }
}

/// Starts one process per stage 1.. of a manifest on loopback, last to first (each is told
/// where its successor listens), pinning stage i to core i*threads when `pin_each`.
pub(crate) fn launch_local_ring(
    manifest_path: &Path,
    threads: usize,
    pin_each: bool,
    wire_dtype: WireDtype,
    name: Option<String>,
    batch: BatchArgs,
    draft: &DraftArgs,
) -> Result<LocalRing> {
    let manifest = Manifest::load(manifest_path)?;
    let dir = manifest_path
        .parent()
        .context("the manifest's folder")?
        .to_path_buf();
    let token_file = dir.join("cluster.token");
    write_token(&token_file)?;
    let token = read_token_file(&token_file)?;
    let ring = std::net::TcpListener::bind("127.0.0.1:0")?;
    // All stages share this machine's memory: each gets an equal part of the KV budget.
    let kv_budget_kib = pipeshard_stage::kv_budget(None) / 1024 / manifest.stages.len() as u64;
    let mut children = Children(Vec::new());
    let mut addrs = vec![String::new(); manifest.stages.len()];
    let mut next = ring.local_addr()?.to_string();
    for s in manifest.stages.iter().skip(1).rev() {
        let cpu = pin_each.then_some(s.index * threads.max(1));
        let (child, addr) = spawn_stage(
            &Manifest::stage_path(manifest_path, s),
            &next,
            &token_file,
            threads,
            cpu,
            wire_dtype,
            kv_budget_kib,
        )?;
        children.0.push(child);
        addrs[s.index] = addr.clone();
        next = addr;
    }
    if pin_each {
        pin(0)?;
    }
    let (local, model, _) = load_head_side(manifest_path, threads, name, draft)?;
    let link = LinkArgs {
        token_file,
        wire_dtype,
        max_message_mib: 64,
        max_step_tokens: 4096,
        max_step_seqs: 256,
    };
    let head_args = HeadArgs {
        model_name: None,
        threads,
        max_body_kib: 1024,
        step_timeout_s: 300,
        batch,
        kv_budget_kib: Some(kv_budget_kib),
        max_queue: 64,
        draft: draft.clone(),
    };
    let config = head_config(&link, &head_args, addrs[1..].to_vec(), token);
    Ok(LocalRing {
        children,
        local,
        model,
        config,
        ring,
    })
}

/// Whether to pin each stage to its own core: `auto` pins when there are enough cores.
pub(crate) fn pin_choice(pin: &str, stages: usize, threads: usize) -> Result<bool> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    Ok(match pin {
        "on" => true,
        "off" => false,
        "auto" => cores >= stages * threads.max(1),
        other => bail!("--pin takes auto, on or off, not `{other}`"),
    })
}

pub fn up(a: UpArgs) -> Result<()> {
    let manifest_path = ensure_split(&a.model, a.stages, a.layers.as_deref())?;
    let stages = Manifest::load(&manifest_path)?.stages.len();
    let pin_each = pin_choice(&a.pin, stages, a.threads)?;
    let name = a.model_name.clone().or_else(|| known_name(&a.model));
    let ring = launch_local_ring(
        &manifest_path,
        a.threads,
        pin_each,
        a.wire_dtype,
        name,
        a.batch,
        &a.draft,
    )?;
    let rt = runtime()?;
    let mut children = None;
    let result = rt.block_on(async {
        let (head, c) = ring.start_head().await?;
        children = Some(c);
        match &a.prompt {
            Some(p) => one_request(&head, p, &a).await,
            None => {
                let api = TcpListener::bind((a.host.as_str(), a.port))
                    .await
                    .with_context(|| format!("listening on {}:{}", a.host, a.port))?;
                let addr: SocketAddr = api.local_addr()?;
                println!(
                    "pipeshard: {} on {} stages at http://{addr}/v1 (Ctrl-C stops)",
                    head.model().name,
                    stages
                );
                std::io::stdout().flush()?;
                serve_api(head, api, 1 << 20).await
            }
        }
    });
    // The head's tasks first, so that stopping the stages is not reported as a failure.
    drop(rt);
    drop(children);
    result
}

fn known_name(model: &str) -> Option<String> {
    pipeshard_shard::known_model(model).map(|m| m.name.to_string())
}

async fn one_request(head: &HeadHandle, prompt: &str, a: &UpArgs) -> Result<()> {
    let text = &head.model().text;
    let rendered = if a.chat {
        text.render_chat(&[ChatMessage::new("user", prompt)])?
    } else {
        prompt.to_string()
    };
    let ids = text.tokenizer.encode(&rendered)?;
    let max_tokens = a
        .max_tokens
        .min(head.model().ctx_len.saturating_sub(ids.len()));
    let started = std::time::Instant::now();
    let mut rx = head.submit(GenRequest {
        prompt: ids,
        sampling: SamplingParams {
            temperature: a.temperature,
            seed: a.seed,
            ..SamplingParams::default()
        },
        max_tokens,
        stops: vec![],
        logprobs: false,
        ignore_eos: false,
        draft_k: None,
    })?;
    let mut out = std::io::stdout();
    let mut all = String::new();
    let mut tokens = Vec::new();
    let mut first_token = None;
    loop {
        match rx.recv().await {
            Some(GenEvent::Text { text, token, .. }) => {
                first_token.get_or_insert_with(|| started.elapsed());
                if let Some(t) = token {
                    tokens.push(t);
                }
                if !a.json {
                    print!("{text}");
                    out.flush()?;
                }
                all.push_str(&text);
            }
            Some(GenEvent::Done {
                finish,
                usage,
                stage_compute_us,
            }) => {
                let total = started.elapsed().as_secs_f64();
                let ttft = first_token.unwrap_or_default().as_secs_f64();
                let decode_tok_s = if usage.completion_tokens > 1 {
                    (usage.completion_tokens - 1) as f64 / (total - ttft).max(1e-9)
                } else {
                    0.0
                };
                if a.json {
                    let v = serde_json::json!({
                        "text": all, "tokens": tokens, "finish_reason": finish, "usage": usage,
                        "ttft_ms": ttft * 1e3, "decode_tok_s": decode_tok_s,
                        "stage_compute_ms": stage_compute_us.iter().map(|u| *u as f64 / 1e3).collect::<Vec<_>>(),
                    });
                    println!("{v}");
                } else {
                    println!();
                    eprintln!(
                        "[{} prompt + {} generated tokens, first token {:.0} ms, {decode_tok_s:.1} tok/s, finish: {finish:?}; compute per stage (ms): {:?}]",
                        usage.prompt_tokens,
                        usage.completion_tokens,
                        ttft * 1e3,
                        stage_compute_us.iter().map(|u| u / 1000).collect::<Vec<_>>()
                    );
                }
                return Ok(());
            }
            Some(GenEvent::Error(e)) => bail!("generation failed: {e}"),
            None => bail!("the head stopped"),
        }
    }
}
