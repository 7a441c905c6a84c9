//! Reading a GGUF file: the header through candle, tensors as raw bytes read one at a time,
//! so a stage reads only its own tensors.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, TensorInfo, Value};

/// A tensor's type and shape (dims in GGUF's row-major order: `[rows, cols]`).
#[derive(Debug, Clone)]
pub struct TensorMeta {
    /// Storage format.
    pub dtype: GgmlDType,
    /// Dimensions.
    pub dims: Vec<usize>,
}
use candle_core::quantized::GgmlDType;

use crate::error::ModelError;
use crate::qweight::QWeight;

/// An open GGUF file: its parsed header and a handle to read tensors from.
pub struct GgufFile {
    path: PathBuf,
    file: File,
    /// Header: metadata, tensor infos, data offset.
    pub content: Content,
}

impl GgufFile {
    /// Opens and parses the header; a file that is not GGUF gets an error naming it.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let mut file = File::open(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let content = Content::read(&mut file).map_err(|e| ModelError::Gguf {
            path: path.to_path_buf(),
            msg: format!("not a readable GGUF file: {e}"),
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
            content,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A metadata value.
    pub fn meta(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    /// A string metadata value.
    pub fn meta_str(&self, key: &str) -> Option<&str> {
        match self.meta(key) {
            Some(Value::String(s)) => Some(s),
            _ => None,
        }
    }

    /// Error helper naming this file.
    pub fn err(&self, msg: impl Into<String>) -> ModelError {
        ModelError::Gguf {
            path: self.path.clone(),
            msg: msg.into(),
        }
    }

    /// Whether a tensor is present.
    pub fn has(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// A tensor's info, or an error naming it.
    pub fn info(&self, name: &str) -> Result<&TensorInfo, ModelError> {
        self.content
            .tensor_infos
            .get(name)
            .ok_or_else(|| self.err(format!("missing tensor `{name}`")))
    }

    /// Size in bytes of a tensor's data.
    pub fn tensor_nbytes(info: &TensorInfo) -> usize {
        let elems = info.shape.elem_count();
        elems / info.ggml_dtype.block_size() * info.ggml_dtype.type_size()
    }

    /// A tensor's type and shape.
    pub fn meta_of(&self, name: &str) -> Result<TensorMeta, ModelError> {
        let info = self.info(name)?;
        Ok(TensorMeta {
            dtype: info.ggml_dtype,
            dims: info.shape.dims().to_vec(),
        })
    }

    /// Reads a tensor's raw bytes into `buf` (which has the tensor's size); a file too short
    /// gets an error saying it is truncated.
    pub fn read_into(&mut self, name: &str, buf: &mut [u8]) -> Result<(), ModelError> {
        let info = self.info(name)?;
        let n = Self::tensor_nbytes(info);
        if buf.len() != n {
            return Err(self.err(format!("tensor `{name}` has {n} bytes, not {}", buf.len())));
        }
        let start = self.content.tensor_data_offset + info.offset;
        let res = self
            .file
            .seek(SeekFrom::Start(start))
            .and_then(|_| self.file.read_exact(buf));
        if let Err(e) = res {
            let msg = if e.kind() == std::io::ErrorKind::UnexpectedEof {
                format!(
                    "truncated: tensor `{name}` needs bytes {start}..{}",
                    start + n as u64
                )
            } else {
                format!("reading tensor `{name}`: {e}")
            };
            return Err(self.err(msg));
        }
        Ok(())
    }

    /// Loads a 2-D weight `[rows, cols]` for row-wise matmul, kept in its quantized form.
    pub fn qweight(&mut self, name: &str) -> Result<QWeight, ModelError> {
        let info = self.meta_of(name)?;
        let dims = &info.dims;
        if dims.len() != 2 {
            return Err(self.err(format!("tensor `{name}` has shape {dims:?}, expected 2-D")));
        }
        QWeight::read(name, info.dtype, dims[0], dims[1], |buf| {
            self.read_into(name, buf)
        })
    }

    /// Loads a 1-D tensor (norm weight, bias) as f32.
    pub fn vector(&mut self, name: &str) -> Result<Vec<f32>, ModelError> {
        let info = self.meta_of(name)?;
        let n: usize = info.dims.iter().product();
        let w = QWeight::read(name, info.dtype, 1, n, |buf| self.read_into(name, buf))?;
        let mut out = vec![0f32; n];
        w.dequantize_row(0, &mut out);
        Ok(out)
    }
}
