//! Who reads the port's input: the session thread itself while it is idle,
//! the reader thread while the session is busy (docs/latency.md, "One
//! wake-up per call").
//!
//! A small call used to wake two threads of the worker: the reader, blocked
//! on the pipe, then the session, parked on the channel the reader hands
//! each message to. An idle session now reads the pipe itself, so a call
//! wakes one thread, as a bare echo does. The reader thread reads only
//! while the session is busy: once the session has served one message for
//! `TAKE_OVER` (a timer wakes the reader then; setting it wakes no one), or
//! at once when the session is about to wait for frames (a run with hooks
//! waits for its caller's `hook_ack`s). So frames behind a long evaluation
//! are read, uploads reassembled and shared files staged as before.
//!
//! Order: one thread at a time reads (the reader's lock), and the reader
//! thread hands each message on before it lets go of the lock, so a
//! session that holds the lock finds every message read before its own
//! already in its channel, and takes those first. The reader thread gives
//! the input back after a message it hands to a session waiting for one.

use crate::connection::{FrameSource, Ready};
use crate::incoming::{self, Reader};
use crate::session::{Inbound, Incoming};
use crate::spin::Spinner;
use crate::sys::{self, Timer};
use crossbeam_channel::{Receiver, Sender};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// How long the session serves one message before the reader thread reads
/// the frames behind it.
pub const TAKE_OVER: Duration = Duration::from_millis(2);

/// The input of the port's worker, shared by its two threads.
pub struct Input<S> {
    reader: Mutex<Held<S>>,
    /// When the session started serving its current message (ns since
    /// `epoch`); 0 while it serves none.
    busy_since: AtomicU64,
    /// The timer is set, or its fire is being handled (the timer is never
    /// unset: a fire that finds the session idle does nothing).
    armed: AtomicBool,
    /// The reader must read at its next fire, however long the session has
    /// been busy.
    urgent: AtomicBool,
    /// The session waits on its channel.
    waiting: AtomicBool,
    timer: Timer,
}

/// What the thread that reads holds: the reader, and the session's spin
/// (only the session spins: the reader thread runs while it is busy).
struct Held<S> {
    reader: Reader<S>,
    spinner: Spinner,
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Now in ns since `epoch`, never 0.
fn now_ns() -> u64 {
    epoch().elapsed().as_nanos() as u64 + 1
}

impl<S: FrameSource + Ready + Send> Input<S> {
    pub fn new(reader: Reader<S>) -> io::Result<Input<S>> {
        epoch();
        Ok(Input {
            reader: Mutex::new(Held {
                reader,
                spinner: Spinner::default(),
            }),
            busy_since: AtomicU64::new(0),
            armed: AtomicBool::new(false),
            urgent: AtomicBool::new(false),
            waiting: AtomicBool::new(false),
            timer: Timer::new()?,
        })
    }

    /// The reader thread: waits for the timer, and reads while the session
    /// is busy. Returns at a clean end of input or when the session is
    /// gone; `Err` on a broken stream.
    pub fn serve(&self, tx: Sender<Incoming>) -> io::Result<()> {
        loop {
            self.timer.wait()?;
            if !self.take_over() {
                continue;
            }
            let mut held = self.reader.lock().unwrap_or_else(PoisonError::into_inner);
            loop {
                let Some(msg) = held.reader.read()? else { return Ok(()) };
                incoming::hand_over(&msg);
                if tx.send(msg).is_err() {
                    return Ok(());
                }
                if self.waiting.load(SeqCst) {
                    break;
                }
            }
            drop(held);
            // A fire set meanwhile stays set: at worst it finds nothing to do.
            self.disarm();
        }
    }

    /// At a fire: whether to read now; otherwise sets the timer again for
    /// what is left of `TAKE_OVER`, or leaves it unset while the session is
    /// idle.
    fn take_over(&self) -> bool {
        if self.urgent.swap(false, SeqCst) {
            return true;
        }
        match self.busy_since.load(SeqCst) {
            0 => {
                self.disarm();
                false
            }
            since => {
                let busy = Duration::from_nanos(now_ns().saturating_sub(since));
                if busy >= TAKE_OVER {
                    return true;
                }
                self.timer.set(Some(TAKE_OVER - busy));
                false
            }
        }
    }

    /// Leaves the timer unset, unless the session started a message
    /// meanwhile and found it still set (so did not set it).
    fn disarm(&self) {
        self.armed.store(false, SeqCst);
        if self.busy_since.load(SeqCst) != 0 && !self.armed.swap(true, SeqCst) {
            self.timer.set(Some(TAKE_OVER));
        }
    }
}

impl<S: FrameSource + Ready + Send> Inbound for Input<S> {
    fn read_here(&self, rx: &Receiver<Incoming>, idle: &mut dyn FnMut()) -> Incoming {
        // Either the reader thread sees `waiting` after its next hand-over
        // and lets go of the input, or this thread sees that message here.
        self.waiting.store(true, SeqCst);
        if let Ok(msg) = rx.try_recv() {
            self.waiting.store(false, SeqCst);
            return msg;
        }
        let mut held = self.reader.try_lock().unwrap_or_else(|_| {
            // The reader thread is reading: what the session has served is
            // acknowledged before it waits (a client waiting for its window
            // sends nothing more).
            idle();
            self.reader.lock().unwrap_or_else(PoisonError::into_inner)
        });
        self.waiting.store(false, SeqCst);
        if let Ok(msg) = rx.try_recv() {
            return msg;
        }
        let Held { reader, spinner } = &mut *held;
        if !reader.frames().ready() {
            // On an idle VM the wake-up from a blocking read costs more than a
            // whole round trip: spin on the pipe a while first (see `spin`).
            let frames = reader.frames();
            spinner.wait_unstamped(
                || frames.ready().then_some(()),
                || {
                    idle();
                    frames.wait();
                },
            );
        }
        match reader.read() {
            Ok(Some(msg)) => {
                incoming::stamp_read(&msg);
                msg
            }
            Ok(None) => end(Ok(())),
            Err(e) => end(Err(e)),
        }
    }

    fn started(&self) {
        self.busy_since.store(now_ns(), SeqCst);
        if !self.armed.swap(true, SeqCst) {
            self.timer.set(Some(TAKE_OVER));
        }
    }

    fn finished(&self) {
        self.busy_since.store(0, SeqCst);
    }

    fn need_reader(&self) {
        self.urgent.store(true, SeqCst);
        self.armed.store(true, SeqCst);
        self.timer.set(Some(Duration::from_nanos(1)));
    }
}

/// The end of the port's input, read by either thread: the worker exits.
pub fn end(read: io::Result<()>) -> ! {
    match read {
        Ok(()) => log::info!("input closed; exiting"),
        Err(e) => log::error!("input stream broken ({e}); exiting"),
    }
    sys::exit_now(0)
}
