//! Same-host transfers through shared memory (protocol.md §6, "Shared
//! memory"). A large upload arrives in a memory file that the worker makes
//! and the client fills; the worker maps the file and MLX adopts the mapping
//! as the tensor's buffer. A large readback is pinned (see `session`) and the
//! client reads it straight out of the worker's memory, through
//! `/proc/<pid>/mem`. Either way the bytes are copied once, and nothing
//! outlives the worker: memory files have no name, and a pin is memory of
//! the worker's own.
//!
//! Where the client can map files (its NIF is loaded), a large readback
//! goes in a memory file sealed against shrinking and writing instead
//! (`Sealed`): the worker copies the tensor into it once, the client maps
//! it read-only and hands the mapping to the VM as a binary, with no copy on
//! its side; the file's pages outlive the worker for as long as the VM
//! holds that binary, and a sealed file cannot be truncated under it. A
//! tensor's sealed copy is kept as cache (`budget::keep`) for its next
//! readback, until the tensor is released.
//!
//! A memory file whose tensor is gone is kept for the next upload of the
//! same size, as MLX keeps freed buffers: writing into pages that exist is
//! much faster than into new ones (about twice, bench/foundation.exs). The
//! budget keeps them (`budget::keep`): they count as cache (`memory_info`'s
//! `cache`), within the cache limit, and go with `clear_cache` or when a
//! request fits only without the cache.

use crate::budget::{self, budget, Held};
use crate::failure::Failure;
use crate::mlx::{Array, Dtype};
use crate::protocol::{self, FROM_BINARY as OP};
use crate::sys::{self, Mapping};
use crate::term::Term;
use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// Memory files kept open at most (by live tensors, sealed readback copies
/// and the cache), far below the usual descriptor limit; past it, files are
/// closed once mapped and not reused.
const MAX_KEPT: usize = 1024;

/// A memory file waiting for the client to write a tensor's bytes into it.
pub struct Staged {
    file: Kept,
    shape: Vec<i32>,
    dtype: Dtype,
    len: usize,
    held: Held,
}

impl Staged {
    /// A file of exactly `len` bytes, a cached one if there is one; they
    /// count against the memory limit from now on, as the client is about to
    /// fill them.
    pub fn new(shape: Vec<i32>, dtype: Dtype, len: usize) -> Result<Staged, Failure> {
        if len == 0 {
            return Err(Failure::invalid(OP, "an empty tensor travels in its from_binary frame"));
        }
        // Taken first, so that making room does not clear the very file
        // reused; given back if there is no room.
        let cached = budget::take_kept::<Kept>(len);
        let held = match budget().hold(len) {
            Ok(held) => held,
            Err(e) => {
                if let Some(file) = cached {
                    budget::keep(len, file);
                }
                return Err(Failure::memory_limit(OP, &e));
            }
        };
        let file = match cached {
            Some(file) => file,
            None => Kept::new(new_file(len).map_err(|m| Failure::system(OP, m))?),
        };
        Ok(Staged {
            file,
            shape,
            dtype,
            len,
            held,
        })
    }

    /// `%{path: "/proc/<pid>/fd/<fd>", inode: n}`: where the client opens
    /// the file, and the inode by which it checks that it opened this one.
    pub fn location(&self) -> Result<Term, Failure> {
        let inode = self
            .file
            .0
            .metadata()
            .map_err(|e| Failure::system(OP, format!("cannot stat a shared file: {e}")))?
            .ino();
        let path = format!("/proc/{}/fd/{}", sys::os_pid(), self.file.0.as_raw_fd());
        Ok(protocol::map(vec![
            ("inode", Term::int(inode)),
            ("path", Term::Binary(path.into_bytes())),
        ]))
    }

    /// Maps what the client wrote, pages in place. The file stays open, to
    /// be cached once its tensor is gone (unless too many are open).
    pub fn map(self) -> Result<Mapped, Failure> {
        let mapping = Mapping::of_file(&self.file.0, self.len, 64)
            .map_err(|e| Failure::system(OP, format!("cannot map the shared file of {} bytes: {e}", self.len)))?;
        let file = (KEPT.load(Ordering::Acquire) <= MAX_KEPT).then_some(self.file);
        let data = mapping.data() as usize;
        let exported = file.as_ref().map(|file| {
            let exported = Arc::new(AtomicBool::new(false));
            uploads().push(Upload {
                data,
                len: self.len,
                fd: file.0.as_raw_fd(),
                exported: exported.clone(),
            });
            exported
        });
        let after = After {
            _held: self.held,
            file,
            len: self.len,
            data,
            exported,
        };
        Ok(Mapped {
            mapping,
            shape: self.shape,
            dtype: self.dtype,
            after,
        })
    }
}

fn new_file(len: usize) -> Result<File, String> {
    let file = sys::memory_file(c"moat-upload").map_err(|e| format!("cannot create a shared file: {e}"))?;
    file.set_len(len as u64)
        .map_err(|e| format!("cannot size a shared file to {len} bytes: {e}"))?;
    sys::seal_size(&file).map_err(|e| format!("cannot seal a shared file: {e}"))?;
    Ok(file)
}

/// A filled memory file, mapped, on its way to becoming a tensor.
pub struct Mapped {
    mapping: Mapping,
    shape: Vec<i32>,
    dtype: Dtype,
    after: After,
}

impl Mapped {
    /// The tensor over the mapping. The budget stays held until MLX lets go
    /// of the memory; the file is cached then.
    pub fn into_array(self) -> crate::mlx::Result<Array> {
        Array::over_mapping(self.mapping, self.after, &self.shape, self.dtype)
    }
}

/// What happens once MLX lets go of a mapped upload (after the unmapping):
/// its bytes stop counting as live, and its file, if kept and never
/// exported, is cached.
struct After {
    _held: Held,
    file: Option<Kept>,
    len: usize,
    /// The mapping's address, by which `uploads()` knows it.
    data: usize,
    /// Whether a readback exported the file (`export_upload`): it is
    /// closed then, never reused.
    exported: Option<Arc<AtomicBool>>,
}

impl Drop for After {
    fn drop(&mut self) {
        if self.exported.is_some() {
            uploads().retain(|u| u.data != self.data);
        }
        let exported = self.exported.as_ref().is_some_and(|e| e.load(Ordering::Acquire));
        if let Some(file) = self.file.take() {
            if !exported {
                budget::keep(self.len, file);
            }
        }
    }
}

/// A mapped upload whose file is open: what `export_upload` can hand out.
struct Upload {
    data: usize,
    len: usize,
    fd: std::os::fd::RawFd,
    exported: Arc<AtomicBool>,
}

fn uploads() -> std::sync::MutexGuard<'static, Vec<Upload>> {
    static UPLOADS: OnceLock<std::sync::Mutex<Vec<Upload>>> = OnceLock::new();
    // A panic ends the process (main.rs), so the lock is never poisoned in use.
    UPLOADS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// The memory file of the upload that holds `bytes`, made immutable for
/// good (mapped read-only in place and sealed against writes, shrinking and
/// growing, unless `seal` is false: the fault-injection build's
/// `:unsealed`), as (descriptor, file size, offset of `bytes` in it);
/// `None` where no mapped upload holds them. The file is never reused once
/// exported. The caller keeps the array alive while the client opens the
/// file, and keeps MLX from writing into it (`Evaluated::hold`).
pub fn export_upload(bytes: &[u8], seal: bool) -> Result<Option<(std::os::fd::RawFd, usize, usize)>, String> {
    let at = bytes.as_ptr() as usize;
    let uploads = uploads();
    let Some(upload) = uploads
        .iter()
        .find(|u| at >= u.data && bytes.len() <= u.len && at - u.data <= u.len - bytes.len())
    else {
        return Ok(None);
    };
    // SAFETY: `upload.fd` is the open descriptor of the file kept by the
    // upload's `After`, which lives (with the mapping) while the array the
    // caller holds does; ManuallyDrop leaves it open.
    let file = std::mem::ManuallyDrop::new(unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(upload.fd) });
    if !upload.exported.swap(true, Ordering::AcqRel) {
        // SAFETY: `upload.data` is the shared mapping of this file from
        // offset 0, `upload.len` bytes, owned by the upload's `Mapping`; the
        // tensor over it is evaluated, and MLX is kept from writing into it.
        unsafe { sys::remap_read_only(&file, upload.data as *mut u8, upload.len) }
            .map_err(|e| format!("cannot map an upload's file read-only: {e}"))?;
    }
    if seal && !sys::write_sealed(&file) {
        sys::seal_contents(&file).map_err(|e| format!("cannot seal an upload's file: {e}"))?;
    }
    Ok(Some((upload.fd, upload.len, at - upload.data)))
}

/// A tensor's bytes in a memory file nobody can change any more (see the
/// module's doc): what a sealed readback hands the client.
pub struct Sealed {
    file: Kept,
    len: usize,
}

impl Sealed {
    /// A memory file holding `bytes` (at least one), sealed: a spare of
    /// that size if one is ready (see `Spare`), else a new file.
    pub fn of(bytes: &[u8]) -> Result<Sealed, String> {
        use std::os::unix::fs::FileExt;
        let len = bytes.len();
        let file = match budget::take_kept::<Spare>(len) {
            Some(Spare(file)) => file,
            None => {
                Kept::new(sys::memory_file(c"moat-readback").map_err(|e| format!("cannot create a sealed file: {e}"))?)
            }
        };
        // One copy, by write(2): the kernel fills a new file's pages
        // without zeroing them first, as a fault through a mapping would,
        // and a spare's pages are in place already. (Two threads writing
        // halves gain nothing: writes to one file take its inode's lock.)
        file.0
            .write_all_at(bytes, 0)
            .map_err(|e| format!("cannot fill a sealed file of {len} bytes: {e}"))?;
        #[cfg(feature = "fault-injection")]
        let seal = !crate::fault::leave_unsealed();
        #[cfg(not(feature = "fault-injection"))]
        let seal = true;
        if seal {
            sys::seal_contents(&file.0).map_err(|e| format!("cannot seal a readback file: {e}"))?;
        }
        Spare::after_readback(len);
        Ok(Sealed { file, len })
    }

    /// Whether another sealed copy may be kept as cache: memory files kept
    /// open stay within `MAX_KEPT`, far below the descriptor limit.
    pub fn may_keep() -> bool {
        KEPT.load(Ordering::Acquire) <= MAX_KEPT
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `path` and `inode`, as `Staged::location` gives them.
    pub fn location(&self) -> Result<Vec<(&'static str, Term)>, String> {
        let inode = self
            .file
            .0
            .metadata()
            .map_err(|e| format!("cannot stat a sealed file: {e}"))?
            .ino();
        let path = format!("/proc/{}/fd/{}", sys::os_pid(), self.file.0.as_raw_fd());
        Ok(vec![
            ("inode", Term::int(inode)),
            ("path", Term::Binary(path.into_bytes())),
        ])
    }
}

/// A memory file with its pages in place, not sealed yet, made in the
/// background for the next readback of a size read back twice in a row:
/// most of a copy into a new file is the kernel allocating and clearing its
/// pages (docs/latency.md: 24 ms of 64 MiB, against 10 ms into a spare), and
/// for a spare that happens before the readback is asked for. It is kept as
/// cache (`budget::keep`, gone with `clear_cache`); sizes above
/// `Spare::MAX_BYTES` get none.
struct Spare(Kept);

/// Whether a spare is being made (one at a time).
static PREPARING: AtomicBool = AtomicBool::new(false);

/// The size of the last sealed readback.
static LAST_LEN: AtomicUsize = AtomicUsize::new(0);

impl Spare {
    const MAX_BYTES: usize = 256 << 20;

    /// After a sealed readback of `len` bytes: starts making a spare of
    /// that size if the readback before was of the same size (a one-off
    /// size gets none), unless one is being made, it is too large, or it
    /// does not fit the memory limit.
    fn after_readback(len: usize) {
        if LAST_LEN.swap(len, Ordering::AcqRel) != len
            || len > Spare::MAX_BYTES
            || budget().admit(len).is_err()
            || PREPARING.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let since = budget::cleared();
        let made = std::thread::Builder::new().name("moat-spare".into()).spawn(move || {
            // Yields the CPU to the session and the VM, which have the
            // caller waiting; the spare is not needed before the next readback.
            sys::lowest_priority();
            let file = sys::memory_file(c"moat-spare").and_then(|file| sys::allocate(&file, len).map(|()| file));
            match file {
                Ok(file) => budget::keep_unless_cleared(since, len, Spare(Kept::new(file))),
                Err(e) => log::debug!("no spare readback file of {len} bytes: {e}"),
            }
            PREPARING.store(false, Ordering::Release);
        });
        if made.is_err() {
            PREPARING.store(false, Ordering::Release);
        }
    }
}

/// A tensor's sealed copy, kept as cache (`budget::keep`) for its next
/// readback; `id` is the tensor's, dropped from the cache when it goes.
pub struct SealedCopy {
    pub id: crate::protocol::Id,
    pub file: std::sync::Arc<Sealed>,
}

/// An open memory file, counted against `MAX_KEPT`.
struct Kept(File);

static KEPT: AtomicUsize = AtomicUsize::new(0);

impl Kept {
    fn new(file: File) -> Kept {
        KEPT.fetch_add(1, Ordering::AcqRel);
        Kept(file)
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        KEPT.fetch_sub(1, Ordering::AcqRel);
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
            File::open("/dev/urandom")
                .and_then(|mut f| f.read_exact(&mut nonce))
                .ok()
                .map(|()| nonce)
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
