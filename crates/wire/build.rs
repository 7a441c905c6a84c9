//! Generates the tonic/prost code for `proto/pipeline.proto` into OUT_DIR. protoc comes from
//! the `protoc-bin-vendored` crate, so no system package is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    std::env::set_var("PROTOC", protoc);
    let proto = "../../proto/pipeline.proto";
    println!("cargo:rerun-if-changed={proto}");
    tonic_prost_build::configure().compile_protos(&[proto], &["../../proto"])?;
    Ok(())
}
