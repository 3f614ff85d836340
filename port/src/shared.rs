//! Same-host transfers through shared memory (protocol.md §6, "Shared
//! memory"). A large upload arrives in a memory file that the worker makes
//! and the client fills; the worker maps the file and MLX adopts the mapping
//! as the tensor's buffer. A large readback is pinned (see `session`) and the
//! client reads it straight out of the worker's memory, through
//! `/proc/<pid>/mem`. Either way the bytes are copied once, and nothing
//! outlives the worker: memory files have no name, and a pin is memory of
//! the worker's own.

use crate::budget::{budget, Held};
use crate::mlx::{Array, Dtype};
use crate::protocol;
use crate::sys::{self, Mapping};
use crate::term::Term;
use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::sync::OnceLock;

/// A memory file waiting for the client to write a tensor's bytes into it.
pub struct Staged {
    file: File,
    shape: Vec<i32>,
    dtype: Dtype,
    len: usize,
    held: Held,
}

impl Staged {
    /// A file of exactly `len` bytes; they count against the memory limit
    /// from now on, as the client is about to fill them.
    pub fn new(shape: Vec<i32>, dtype: Dtype, len: usize) -> Result<Staged, String> {
        if len == 0 {
            return Err("an empty tensor travels in its from_binary frame".into());
        }
        let held = budget().hold(len).map_err(|e| e.to_string())?;
        let file = sys::memory_file(c"moat-upload").map_err(|e| format!("cannot create a shared file: {e}"))?;
        file.set_len(len as u64).map_err(|e| format!("cannot size a shared file to {len} bytes: {e}"))?;
        sys::seal_size(&file).map_err(|e| format!("cannot seal a shared file: {e}"))?;
        Ok(Staged { file, shape, dtype, len, held })
    }

    /// `%{path: "/proc/<pid>/fd/<fd>", inode: n}`: where the client opens
    /// the file, and the inode by which it checks that it opened this one.
    pub fn location(&self) -> Result<Term, String> {
        let inode = self.file.metadata().map_err(|e| format!("cannot stat a shared file: {e}"))?.ino();
        let path = format!("/proc/{}/fd/{}", sys::os_pid(), self.file.as_raw_fd());
        Ok(protocol::map(vec![("inode", Term::int(inode)), ("path", Term::Binary(path.into_bytes()))]))
    }

    /// Maps what the client wrote, pages in place. The file's own
    /// descriptor closes here; the mapping keeps its memory.
    pub fn map(self) -> Result<Mapped, String> {
        let mapping = Mapping::of_file(&self.file, self.len, 64)
            .map_err(|e| format!("cannot map the shared file of {} bytes: {e}", self.len))?;
        Ok(Mapped { mapping, shape: self.shape, dtype: self.dtype, held: self.held })
    }
}

/// A filled memory file, mapped, on its way to becoming a tensor.
pub struct Mapped {
    mapping: Mapping,
    shape: Vec<i32>,
    dtype: Dtype,
    held: Held,
}

impl Mapped {
    /// The tensor over the mapping. The budget stays held until MLX lets go
    /// of the memory.
    pub fn into_array(self) -> crate::mlx::Result<Array> {
        Array::over_mapping(self.mapping, self.held, &self.shape, self.dtype)
    }
}

/// 16 random bytes at a fixed address in this process. The client reads
/// them through `/proc/<pid>/mem` at startup, to learn that it may read this
/// worker's memory, and before each readback, to check that the process it
/// opened is this worker. `None` if no random bytes could be read.
pub fn probe() -> Option<&'static [u8; 16]> {
    static PROBE: OnceLock<Option<[u8; 16]>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            let mut nonce = [0u8; 16];
            File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut nonce)).ok().map(|()| nonce)
        })
        .as_ref()
}

/// The hello's `shared_memory` entry: `%{address: int, nonce: binary}` when
/// shared memory is offered, `nil` otherwise. It is offered where memory
/// files can be made.
pub fn offer(enabled: bool) -> Term {
    let usable = enabled && sys::memory_file(c"moat-check").is_ok();
    match probe() {
        Some(nonce) if usable => protocol::map(vec![
            ("address", Term::int(nonce.as_ptr() as u64)),
            ("nonce", Term::Binary(nonce.to_vec())),
        ]),
        _ => Term::atom("nil"),
    }
}

