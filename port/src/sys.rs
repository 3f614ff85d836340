//! The few OS calls the worker needs: inherited pipes, parent-death signal,
//! immediate exit. Like `mlx::ffi`, this is FFI. Elsewhere `unsafe` appears
//! only in `mlx` (its safe wrappers over the shim) and where `ops` calls an
//! `mlx::ops` function whose `# Safety` contract (indices in range, strides
//! inside the buffer) it has checked.

use std::ffi::CStr;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::raw::{c_int, c_void};
use std::ptr;

/// Takes ownership of a file descriptor the parent left open for us.
pub fn inherited(fd: RawFd) -> io::Result<File> {
    // SAFETY: F_GETFD only queries the descriptor; it fails if fd is not open.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } == -1 {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("file descriptor {fd} is not open: start the worker as an Erlang port with :nouse_stdio"),
        ));
    }
    // SAFETY: fd is open and nothing else in this process owns it.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// Asks for a larger pipe buffer (fewer wake-ups on big transfers); a refusal
/// is harmless, so it is ignored.
pub fn grow_pipe(fd: RawFd, bytes: i32) {
    // SAFETY: F_SETPIPE_SZ on a non-pipe fails with EBADF/EINVAL, nothing else.
    unsafe { libc::fcntl(fd, libc::F_SETPIPE_SZ, bytes) };
}

/// A file that lives in memory only (a memfd): it has no name in any
/// directory, so it vanishes once the last descriptor and mapping of it are
/// gone, at the latest when the worker exits, however it exits. Another
/// process of the same user opens it as `/proc/<pid>/fd/<fd>`.
pub fn memory_file(name: &CStr) -> io::Result<File> {
    // SAFETY: `name` is NUL-terminated; on success the call returns a new
    // descriptor that nothing else owns.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is open and ours alone.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// The inode of an open descriptor.
pub fn inode(fd: RawFd) -> io::Result<u64> {
    // SAFETY: `st` is a valid out-pointer; fstat only reads `fd`.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.st_ino)
}

/// Fixes a memory file's size for good: no one (the worker or another
/// process holding it open) can shrink it, so a mapping of it never faults
/// past its end (SIGBUS). Further seals stay possible: a readback seals an
/// upload's file against writes once the worker maps it read-only
/// (`shared::export_upload`).
pub fn seal_size(file: &File) -> io::Result<()> {
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    // SAFETY: F_ADD_SEALS takes an int; it fails on files that do not allow sealing.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Fixes a memory file's size and contents for good (`seal_size`, and no
/// one can write it any more): a reader may map it and take its bytes for
/// immutable. Fails while the file is mapped writable.
pub fn seal_contents(file: &File) -> io::Result<()> {
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE | libc::F_SEAL_SEAL;
    // SAFETY: F_ADD_SEALS takes an int; it fails on files that do not allow sealing.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Replaces the shared mapping of `file` at `data` (`len` bytes, from the
/// file's start) by a read-only one of the same pages at the same address,
/// mapped through a read-only descriptor: a shared mapping of a descriptor
/// open for writing counts as writable, and would refuse the write seal
/// (EBUSY). Pointers into the mapping stay valid. If the kernel refuses
/// after it may have unmapped the old pages, the process ends: nothing
/// could read them safely any more.
///
/// # Safety
///
/// `data..data + len` must be exactly a shared mapping of `file` from offset
/// 0 that this process owns, and nothing may write into it from now on.
pub unsafe fn remap_read_only(file: &File, data: *mut u8, len: usize) -> io::Result<()> {
    let path = format!("/proc/self/fd/{}", file.as_raw_fd());
    let read_only = File::open(&path)?;
    // SAFETY: the caller owns the mapping at `data`, which MAP_FIXED replaces
    // with the same file's pages.
    let mapped = unsafe {
        libc::mmap(
            data as *mut libc::c_void,
            len,
            libc::PROT_READ,
            libc::MAP_SHARED | libc::MAP_FIXED,
            read_only.as_raw_fd(),
            0,
        )
    };
    if mapped == libc::MAP_FAILED {
        log::error!(
            "cannot map a shared file read-only in place: {}",
            io::Error::last_os_error()
        );
        std::process::abort();
    }
    Ok(())
}

/// Whether a memory file is sealed against writes already.
pub fn write_sealed(file: &File) -> bool {
    // SAFETY: F_GET_SEALS takes no argument.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    seals >= 0 && seals & libc::F_SEAL_WRITE != 0
}

/// Gives a memory file `len` bytes with their pages in place (allocated and
/// cleared now), so that writing them later only copies.
pub fn allocate(file: &File, len: usize) -> io::Result<()> {
    let len = libc::off_t::try_from(len).map_err(|_| io::ErrorKind::InvalidInput)?;
    // SAFETY: fallocate takes a descriptor and two offsets; mode 0 only
    // allocates (and extends the file to `len`).
    if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Gives the calling thread the lowest priority (nice 19), for work
/// nobody waits for. Best effort: a thread left at its priority only runs
/// sooner.
pub fn lowest_priority() {
    // SAFETY: gettid takes nothing; setpriority with PRIO_PROCESS and a
    // thread id changes that thread's nice value only (Linux).
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 19);
    }
}

/// `len` bytes of a file, mapped shared and writable, preceded by at least
/// `room` writable bytes of private memory (MLX's allocator keeps a header
/// just before a buffer's data). Unmapped on drop.
pub struct Mapping {
    region: *mut u8,
    total: usize,
    data: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by exactly one `Mapping`;
// munmap may be called from any thread.
unsafe impl Send for Mapping {}

impl Mapping {
    /// Maps the first `len` bytes of `file` (which must have at least that
    /// many), with its pages in place already, so that no later access
    /// faults them in. `len` must be positive.
    pub fn of_file(file: &File, len: usize, room: usize) -> io::Result<Mapping> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "nothing to map"));
        }
        let page = page_size();
        let lead = room.div_ceil(page).max(1) * page;
        let total = lead.checked_add(len).ok_or(io::ErrorKind::InvalidInput)?;
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        // SAFETY: a fresh anonymous mapping at an address the kernel picks;
        // no existing memory is affected.
        let region = unsafe {
            libc::mmap(
                ptr::null_mut(),
                total,
                rw,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if region == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let region = region as *mut u8;
        // SAFETY: `lead < total`, so the address is inside the region.
        let data = unsafe { region.add(lead) };
        let flags = libc::MAP_SHARED | libc::MAP_FIXED | libc::MAP_POPULATE;
        // SAFETY: MAP_FIXED replaces only pages of the region reserved above,
        // which nothing else uses yet.
        let mapped = unsafe { libc::mmap(data as *mut libc::c_void, len, rw, flags, file.as_raw_fd(), 0) };
        if mapped == libc::MAP_FAILED {
            let e = io::Error::last_os_error();
            // SAFETY: unmaps exactly the region mapped above.
            unsafe { libc::munmap(region as *mut libc::c_void, total) };
            return Err(e);
        }
        Ok(Mapping {
            region,
            total,
            data,
            len,
        })
    }

    /// The file's bytes.
    pub fn data(&self) -> *mut u8 {
        self.data
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Writable bytes right before `data()`.
    pub fn room(&self) -> usize {
        self.data as usize - self.region as usize
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the region this `Mapping` mapped and owns.
        unsafe { libc::munmap(self.region as *mut libc::c_void, self.total) };
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf takes a constant and touches no memory of ours.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as usize
    } else {
        4096
    }
}

/// Dies with SIGKILL when the parent (the VM's child launcher) exits, even
/// while MLX is busy and no thread reads the input pipe.
pub fn die_with_parent() {
    // SAFETY: prctl with PR_SET_PDEATHSIG takes a signal number and no pointers.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
    // The parent may have died before the prctl took effect.
    // SAFETY: getppid has no preconditions.
    if unsafe { libc::getppid() } == 1 {
        exit_now(0);
    }
}

/// Keeps the read end of the request pipe `fd` open in a small child process
/// until the VM closes its end. Without it, the worker's death closes the
/// pipe, and a VM still writing requests gets EPIPE, which closes the port
/// before the worker's exit status arrives: callers would learn that the
/// worker died but not how (a signal, a panic, the OOM killer). With it, the
/// VM's writes wait in the pipe, the exit status arrives, and the VM closes
/// the port; the holder sees that (or the VM's death) and exits. It runs
/// nothing but `poll`. Call it before any thread starts.
pub fn hold_input_open(fd: RawFd) {
    // SAFETY: fork has no memory-safety preconditions; the child runs only
    // async-signal-safe calls (see `holder`) and never returns.
    match unsafe { libc::fork() } {
        0 => holder(fd),
        -1 => log::warn!(
            "cannot fork the input holder ({}): exit causes may be lost",
            io::Error::last_os_error()
        ),
        _ => {}
    }
}

fn holder(fd: RawFd) -> ! {
    // SAFETY: each call below is async-signal-safe, takes plain values or a
    // pointer to a local that outlives it, and touches no Rust state.
    unsafe {
        libc::prctl(libc::PR_SET_NAME, c"moat_port-hold".as_ptr());
        // Everything but the request pipe: above all not the reply pipe, whose
        // end of file tells the VM that the worker is gone.
        let max = libc::c_uint::MAX;
        if fd > 0 {
            libc::syscall(
                libc::SYS_close_range,
                0 as libc::c_uint,
                (fd - 1) as libc::c_uint,
                0 as libc::c_uint,
            );
        }
        if libc::syscall(libc::SYS_close_range, (fd + 1) as libc::c_uint, max, 0 as libc::c_uint) != 0 {
            for other in (0..1024).filter(|other| *other != fd) {
                libc::close(other);
            }
        }
        // No events asked for: poll returns only on hang-up or error, that
        // is once no writer is left.
        let mut pfd = libc::pollfd {
            fd,
            events: 0,
            revents: 0,
        };
        while libc::poll(&mut pfd, 1, -1) < 1 {}
        libc::_exit(0)
    }
}

/// The BEAM ignores SIGCHLD and ports inherit that; MLX's CPU compiler waits
/// for the g++ it spawns, which needs the default disposition.
pub fn default_sigchld() {
    // SAFETY: installing SIG_DFL for SIGCHLD has no memory-safety preconditions.
    unsafe { libc::signal(libc::SIGCHLD, libc::SIG_DFL) };
}

/// Whether reading `fd` would return at once: it has data, or its writer
/// has hung up (a read then returns end of file). With `block`, waits
/// until it would (or a signal interrupts the wait).
pub fn readable(fd: RawFd, block: bool) -> bool {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd on the stack, outliving the call.
    unsafe { libc::poll(&mut pfd, 1, if block { -1 } else { 0 }) > 0 }
}

/// A one-shot timer another thread can wait on (a timerfd): setting it
/// costs a system call and wakes no one; only its expiry wakes the waiter.
pub struct Timer(File);

impl Timer {
    pub fn new() -> io::Result<Timer> {
        // SAFETY: timerfd_create takes two flags; on success the descriptor is ours alone.
        let fd = unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is open and owned by nothing else.
        Ok(Timer(unsafe { File::from_raw_fd(fd) }))
    }

    /// Fires once after `after` (at least 1 ns); `None` disarms it. Either
    /// way an expiry not yet waited for is forgotten.
    pub fn set(&self, after: Option<std::time::Duration>) {
        let value = after.map_or(libc::timespec { tv_sec: 0, tv_nsec: 0 }, |d| libc::timespec {
            tv_sec: d.as_secs() as libc::time_t,
            tv_nsec: (d.subsec_nanos() as libc::c_long).max(if d.as_secs() == 0 { 1 } else { 0 }),
        });
        let spec = libc::itimerspec {
            it_interval: libc::timespec { tv_sec: 0, tv_nsec: 0 },
            it_value: value,
        };
        // SAFETY: `spec` lives on the stack for the call; a null old value is allowed.
        unsafe { libc::timerfd_settime(self.0.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
    }

    /// Blocks until the timer fires.
    pub fn wait(&self) -> io::Result<()> {
        let mut ticks = [0u8; 8];
        loop {
            match (&self.0).read(&mut ticks) {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// Exits at once, without running destructors or waiting for other threads
/// (one may be inside MLX).
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit never returns and touches no Rust state.
    unsafe { libc::_exit(code) }
}

pub fn os_pid() -> u32 {
    std::process::id()
}

/// The real user id of this process.
pub fn uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

/// The exit status of a worker whose GPU context was lost (a CUDA fault).
pub const EXIT_GPU_LOST: i32 = 75;

/// The CPU time (user and system) of every thread of this process, in µs.
pub fn cpu_time_us() -> u64 {
    // SAFETY: getrusage writes into the zeroed struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let us = |t: libc::timeval| (t.tv_sec.max(0) as u64) * 1_000_000 + t.tv_usec.max(0) as u64;
    us(usage.ru_utime) + us(usage.ru_stime)
}

/// The utilization of one GPU as NVML samples it: a long GPU computation
/// leaves the CPU idle, so the watchdog counts the GPU's busy time too.
pub struct GpuLoad {
    get: unsafe extern "C" fn(*mut c_void, *mut NvmlUtilization) -> c_int,
    device: *mut c_void,
}

#[repr(C)]
struct NvmlUtilization {
    gpu: u32,
    memory: u32,
}

// SAFETY: NVML handles may be used from any thread (NVML is thread-safe).
unsafe impl Send for GpuLoad {}

impl GpuLoad {
    /// The GPU this process sees as device 0 (`CUDA_VISIBLE_DEVICES`, when it
    /// names one index; NVML counts in the same PCI order for identical GPUs).
    /// None without NVML.
    pub fn open() -> Option<GpuLoad> {
        let index = std::env::var("CUDA_VISIBLE_DEVICES")
            .ok()
            .and_then(|v| v.trim().parse::<u32>().ok())
            .unwrap_or(0);
        // SAFETY: dlopen and dlsym take NUL-terminated names; the symbols
        // have the signatures NVML's header declares, and the library stays
        // loaded (never dlclosed) while the pointers are used.
        unsafe {
            let lib = libc::dlopen(c"libnvidia-ml.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
            if lib.is_null() {
                return None;
            }
            let init = libc::dlsym(lib, c"nvmlInit_v2".as_ptr());
            let by_index = libc::dlsym(lib, c"nvmlDeviceGetHandleByIndex_v2".as_ptr());
            let get = libc::dlsym(lib, c"nvmlDeviceGetUtilizationRates".as_ptr());
            if init.is_null() || by_index.is_null() || get.is_null() {
                return None;
            }
            let init: unsafe extern "C" fn() -> c_int = std::mem::transmute(init);
            let by_index: unsafe extern "C" fn(u32, *mut *mut c_void) -> c_int = std::mem::transmute(by_index);
            let mut device = std::ptr::null_mut();
            if init() != 0 || by_index(index, &mut device) != 0 {
                return None;
            }
            Some(GpuLoad {
                get: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut c_void, *mut NvmlUtilization) -> c_int>(
                    get,
                ),
                device,
            })
        }
    }

    /// The percentage of NVML's last sample period in which a kernel ran.
    pub fn utilization(&self) -> Option<u64> {
        let mut u = NvmlUtilization { gpu: 0, memory: 0 };
        // SAFETY: `device` is NVML's handle; `u` is a valid out-pointer.
        (unsafe { (self.get)(self.device, &mut u) } == 0).then_some(u64::from(u.gpu.min(100)))
    }
}

/// The machine's RAM in bytes (0 if the system does not say).
pub fn physical_memory() -> u64 {
    // SAFETY: sysconf reads system constants; no pointers.
    let (pages, size) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    (pages.max(0) as u64).saturating_mul(size.max(0) as u64)
}

/// The ways MLX takes a process down, reproduced on purpose. Only test builds
/// (feature `fault-injection`) have them.
#[cfg(feature = "fault-injection")]
pub mod crash {
    /// SIGSEGV from a real invalid write, like MLX writing through the null
    /// pointer of a failed allocation.
    pub fn segfault() -> ! {
        // SAFETY: deliberately not sound: a dangling pointer is address 8,
        // which is never mapped (below vm.mmap_min_addr), so the write faults
        // and the process dies.
        unsafe { std::ptr::write_volatile(std::ptr::dangling_mut::<u64>(), 0) };
        std::process::abort()
    }

    /// SIGFPE from a real division trap: `i32::MIN / -1` in `idiv`, which is
    /// what MLX's CPU kernels do on `INT_MIN // -1`.
    #[cfg(target_arch = "x86_64")]
    pub fn divide_overflow() -> ! {
        // SAFETY: deliberately traps (#DE); touches only the named registers.
        unsafe {
            std::arch::asm!(
                "cdq",
                "idiv {d:e}",
                d = in(reg) -1i32,
                inout("eax") i32::MIN => _,
                out("edx") _,
            )
        };
        std::process::abort()
    }

    /// SIGFPE (other architectures do not trap on integer division).
    #[cfg(not(target_arch = "x86_64"))]
    pub fn divide_overflow() -> ! {
        // SAFETY: raise takes a signal number and no pointers.
        unsafe { libc::raise(libc::SIGFPE) };
        std::process::abort()
    }

    /// SIGKILL, as the OOM killer sends it.
    pub fn kill() -> ! {
        // SAFETY: kill takes a pid and a signal number, no pointers.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        std::process::abort()
    }
}
