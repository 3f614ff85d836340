//! Same-host transfers through shared memory (protocol.md §6, "Shared
//! memory"), and what happens to uploads whose sender gives up, through a
//! real worker: this test process plays the client, opening the worker's
//! memory files and reading its memory the way the BEAM does.

mod common;

use common::*;
use moat_port::term::Term;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;

/// A blocking call: its result, or the error tuple.
fn call(w: &mut Worker, seq: u64, op: &str, outs: &[u64], ins: &[u64], attrs: Term) -> Result<(Term, Vec<u8>), Term> {
    w.request(seq, op, outs, ins, attrs);
    let (reply, payload) = w.recv();
    let items = reply.as_tuple().expect("reply").to_vec();
    assert_eq!(items[1], Term::int(seq), "reply to {seq}: {reply}");
    if items[0].is_atom("ok") {
        Ok((items[2].clone(), payload))
    } else {
        Err(reply)
    }
}

fn int(t: &Term, key: &str) -> u64 {
    t.get(key)
        .and_then(Term::as_int)
        .unwrap_or_else(|| panic!("no {key} in {t}")) as u64
}

fn active(w: &mut Worker, seq: u64) -> usize {
    int(&call(w, seq, "memory_info", &[], &[], nil()).unwrap().0, "active") as usize
}

/// `active` once it is `want`, or as it is after a second. On a GPU, MLX
/// frees the buffers a finished kernel read and wrote on its completion
/// thread, a moment after the kernel: a count taken right after a release
/// may still include them (32 bytes were seen on the H200), so there the
/// count is taken again until it settles. The CPU's count is exact at once.
fn settled_active(w: &mut Worker, seq: u64, want: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        let n = active(w, seq);
        if n == want || !w.on_gpu() || Instant::now() > deadline {
            return n;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn pin(min: usize) -> Term {
    moat_port::protocol::map(vec![("pin", Term::int(min as u64))])
}

/// Bytes that differ from one position to the next.
fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + i / 4096) as u8).collect()
}

/// The hello's `shared_memory` entry.
fn offer(w: &Worker) -> Term {
    let info = &w.hello.as_tuple().unwrap()[2];
    info.get("shared_memory").cloned().expect("shared_memory in the hello")
}

/// `upload_file` of a tensor: the file's location, or the error tuple.
fn stage(w: &mut Worker, seq: u64, id: u64, shape: &[i32], kind: &str, bits: u32) -> Result<Term, Term> {
    let bytes = shape.iter().map(|&d| d as usize).product::<usize>() * bits as usize / 8;
    let attrs = tensor_attrs(shape, kind, bits, bytes);
    call(w, seq, "upload_file", &[id], &[], attrs).map(|(location, _)| location)
}

/// The path in an `upload_file` reply.
fn path(location: &Term) -> String {
    match location.get("path") {
        Some(Term::Binary(path)) => String::from_utf8_lossy(path).into_owned(),
        _ => panic!("no path in {location}"),
    }
}

/// What the client does with an `upload_file` reply: opens the file by its
/// path, checks the inode, writes the bytes.
fn fill(location: &Term, bytes: &[u8]) {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path(location))
        .expect("open the shared file");
    assert_eq!(file.metadata().unwrap().ino(), int(location, "inode"));
    file.write_all_at(bytes, 0).expect("write the shared file");
}

fn upload_shared(w: &mut Worker, seq: u64, id: u64, shape: &[i32], bytes: &[u8]) {
    let location = stage(w, seq, id, shape, "u", 8).unwrap();
    fill(&location, bytes);
    w.request(0, "from_file", &[id], &[], nil());
}

fn read_memory(w: &Worker, address: u64, len: usize) -> Vec<u8> {
    let mem = File::open(format!("/proc/{}/mem", w.pid())).expect("open /proc/<pid>/mem");
    let mut out = vec![0u8; len];
    mem.read_exact_at(&mut out, address).expect("read the worker's memory");
    out
}

#[test]
fn the_hello_offers_a_probe_the_client_can_read() {
    let w = Worker::start(&[]);
    let offer = offer(&w);
    let Some(Term::Binary(nonce)) = offer.get("nonce") else {
        panic!("no nonce in {offer}")
    };
    assert_eq!(nonce.len(), 16);
    assert_eq!(&read_memory(&w, int(&offer, "address"), 16), nonce);
    w.close(Duration::from_secs(1));
}

#[test]
fn an_upload_through_a_shared_file_arrives_intact_and_is_counted() {
    let mut w = Worker::start(&[]);
    let bytes = pattern(3 * MIB + 5);
    let before = active(&mut w, 1);
    upload_shared(&mut w, 2, 1, &[bytes.len() as i32], &bytes);
    let info = call(&mut w, 3, "memory_info", &[], &[], nil()).unwrap().0;
    let live = int(&info, "active") as usize - before;
    if w.on_gpu() {
        // Copied to the card: the CUDA allocator rounds the size up.
        assert!(
            (bytes.len()..bytes.len() + 64 * 1024).contains(&live),
            "the copy counts as live: {live}"
        );
    } else {
        assert_eq!(live, bytes.len(), "the mapping counts as live");
    }
    assert!(int(&info, "peak") >= int(&info, "active"), "and in the peak: {info}");
    assert_eq!(w.read(4, 1).unwrap().1, bytes);
    w.request(0, "release", &[], &[1], nil());
    assert_eq!(active(&mut w, 5), before, "released with its tensor");
    w.close(Duration::from_secs(1));
}

#[test]
fn mlx_may_reuse_a_mapped_buffer_for_a_result() {
    // An input that nothing else holds may become its result's buffer
    // (MLX's donation): the mapping must be writable and freed once, later.
    let mut w = Worker::start(&[]);
    let n = MIB / 4;
    let values: Vec<u8> = (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let location = stage(&mut w, 1, 1, &[n as i32], "f", 32).unwrap();
    fill(&location, &values);
    w.request(0, "from_file", &[1], &[], nil());
    w.upload_f32(2, &[1], &[1.0]);
    w.request(0, "add", &[3], &[1, 2], typed("f", 32));
    w.request(0, "release", &[], &[1], nil());
    let sums = w.read_f32(2, 3);
    assert!(sums.iter().enumerate().all(|(i, v)| *v == i as f32 + 1.0));
    // The sum lives in the mapping (on a GPU, in the upload's copy):
    // nothing but the scalar was allocated, which the CUDA allocator rounds
    // up to 8 bytes.
    let scalar = if w.on_gpu() { 8 } else { 4 };
    assert_eq!(
        active(&mut w, 9),
        values.len() + scalar,
        "MLX wrote the result into the mapped buffer"
    );
    w.request(0, "release", &[], &[2, 3], nil());
    assert_eq!(settled_active(&mut w, 3, 0), 0);
    w.close(Duration::from_secs(1));
}

#[test]
fn a_pinned_readback_is_read_from_the_workers_memory_until_released() {
    let mut w = Worker::start(&[]);
    let bytes = pattern(2 * MIB);
    upload_shared(&mut w, 1, 1, &[bytes.len() as i32], &bytes);
    // Under the threshold, the bytes come in the reply as before.
    let big = bytes.len() + 1;
    let (info, payload) = call(&mut w, 2, "to_binary", &[10], &[1], pin(big)).unwrap();
    assert!(info.get("address").is_none());
    assert_eq!(payload, bytes);
    // At the threshold, the reply carries the address instead.
    let (info, payload) = call(&mut w, 3, "to_binary", &[11], &[1], pin(bytes.len())).unwrap();
    assert!(payload.is_empty());
    assert_eq!(int(&info, "bytes") as usize, bytes.len());
    assert_eq!(read_memory(&w, int(&info, "address"), bytes.len()), bytes);
    // A pin of a lazy result holds its evaluated copy until released.
    w.upload_f32(2, &[4], &[1.0, 2.0, 3.0, 4.0]);
    w.request(0, "add", &[3], &[2, 2], typed("f", 32));
    w.request(0, "release", &[], &[1, 2], nil());
    let (info, _) = call(&mut w, 4, "to_binary", &[12], &[3], pin(1)).unwrap();
    w.request(0, "release", &[], &[3], nil());
    let twos: Vec<u8> = [2.0f32, 4.0, 6.0, 8.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(read_memory(&w, int(&info, "address"), 16), twos);
    assert!(active(&mut w, 5) >= bytes.len(), "pin 11 still holds the upload");
    w.request(0, "release", &[], &[11, 12], nil());
    assert_eq!(settled_active(&mut w, 6, 0), 0, "nothing is left once the pins go");
    w.close(Duration::from_secs(1));
}

#[test]
fn a_pin_id_is_defined_once_and_bad_pin_requests_name_to_binary() {
    let mut w = Worker::start(&[]);
    w.upload_f32(1, &[1], &[5.0]);
    call(&mut w, 1, "to_binary", &[10], &[1], pin(1)).unwrap();
    let (op, message) = error_parts(&call(&mut w, 2, "to_binary", &[10], &[1], pin(1)).unwrap_err());
    assert_eq!(
        (op.as_str(), message.as_str()),
        ("to_binary", "tensor id 10 is already defined")
    );
    for (outs, attrs) in [
        (vec![], pin(1)),
        (vec![11, 12], pin(1)),
        (vec![11], nil()),
        (vec![11], Term::int(4)),
    ] {
        let (op, message) = error_parts(&call(&mut w, 3, "to_binary", &outs, &[1], attrs).unwrap_err());
        assert_eq!(op, "to_binary");
        assert!(
            message.contains("to_binary takes attrs nil, or %{pin: min_bytes} with one out id"),
            "{message}"
        );
    }
    w.close(Duration::from_secs(1));
}

#[test]
fn a_shared_file_released_before_it_is_used_goes_with_its_budget() {
    let mut w = Worker::start(&[]);
    let location = stage(&mut w, 1, 1, &[MIB as i32], "u", 8).unwrap();
    assert_eq!(active(&mut w, 2), MIB, "held from the start");
    // The sender died before from_file: its handle's release arrives instead.
    w.request(0, "release", &[], &[1], nil());
    assert_eq!(active(&mut w, 3), 0);
    let path = path(&location);
    assert!(
        std::fs::read_link(&path).map_or(true, |t| !t.to_string_lossy().contains("moat-upload")),
        "{path} still open"
    );
    w.request(0, "from_file", &[1], &[], nil());
    let (op, message) = error_parts(&w.recv().0);
    assert_eq!(op, "from_binary");
    assert!(message.contains("no shared file for tensor id 1"), "{message}");
    w.close(Duration::from_secs(1));
}

#[test]
fn a_shared_file_cannot_be_shrunk_under_its_mapping() {
    let mut w = Worker::start(&[]);
    let location = stage(&mut w, 1, 1, &[MIB as i32], "u", 8).unwrap();
    let file = OpenOptions::new().write(true).open(path(&location)).unwrap();
    assert!(file.set_len(16).is_err(), "the size is sealed");
    assert!(OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path(&location))
        .is_err());
    w.request(0, "from_file", &[1], &[], nil());
    assert_eq!(
        w.read(2, 1).unwrap().1,
        vec![0u8; MIB],
        "bytes never written read as zeros"
    );
    w.close(Duration::from_secs(1));
}

#[test]
fn shared_files_count_against_the_memory_limit() {
    let mut w = Worker::start(&[]);
    call(&mut w, 1, "set_memory_limit", &[], &[], Term::int(4 * MIB as u64)).unwrap();
    let (op, message) = error_parts(&stage(&mut w, 2, 1, &[8 << 20], "u", 8).unwrap_err());
    assert_eq!(op, "from_binary");
    assert!(message.contains("memory limit exceeded: needs 8.0 MiB"), "{message}");
    stage(&mut w, 3, 2, &[3 << 20], "u", 8).unwrap();
    let (_, message) = error_parts(&stage(&mut w, 4, 3, &[2 << 20], "u", 8).unwrap_err());
    assert!(message.contains("3.0 MiB in use"), "the first file counts: {message}");
    // The refused id is poisoned with the refusal.
    let (op, _) = error_parts(&w.read(5, 1).unwrap_err());
    assert_eq!(op, "from_binary");
    w.close(Duration::from_secs(1));
}

#[test]
fn bad_shared_uploads_are_refused_with_the_op_named() {
    let mut w = Worker::start(&[]);
    let attrs = || tensor_attrs(&[4], "u", 8, 4);
    let refusals = [
        (
            "upload_file",
            vec![1u64],
            tensor_attrs(&[4], "u", 8, 5),
            "bytes is 5 but the shape and dtype need 4",
        ),
        (
            "upload_file",
            vec![],
            attrs(),
            "upload_file defines exactly one id and reads none",
        ),
        (
            "upload_file",
            vec![2],
            tensor_attrs(&[0], "u", 8, 0),
            "an empty tensor travels in its from_binary frame",
        ),
    ];
    for (seq, (op, outs, attrs, why)) in refusals.into_iter().enumerate() {
        let (failed, message) = error_parts(&call(&mut w, seq as u64 + 1, op, &outs, &[], attrs).unwrap_err());
        assert_eq!(failed, "from_binary", "{op}");
        assert!(message.contains(why), "{message}");
    }
    // A call, so that its reply can carry the location.
    w.request(0, "upload_file", &[3], &[], attrs());
    let (op, message) = error_parts(&w.recv().0);
    assert_eq!(op, "from_binary");
    assert!(message.contains("upload_file is a call"), "{message}");
    w.request(0, "from_file", &[4], &[], nil());
    let (op, message) = error_parts(&w.recv().0);
    assert_eq!(op, "from_binary");
    assert!(message.contains("no shared file for tensor id 4"), "{message}");
    call(&mut w, 9, "upload_file", &[5], &[], attrs()).unwrap();
    let (_, message) = error_parts(&call(&mut w, 10, "upload_file", &[5], &[], attrs()).unwrap_err());
    assert!(message.contains("tensor id 5 is already being uploaded"), "{message}");
    w.close(Duration::from_secs(1));
}

#[test]
fn a_worker_started_without_shared_memory_offers_none_and_answers_through_the_pipe() {
    let mut w = Worker::start(&["--shared-memory", "false"]);
    assert_eq!(offer(&w), nil());
    let (op, message) =
        error_parts(&call(&mut w, 1, "upload_file", &[1], &[], tensor_attrs(&[4], "u", 8, 4)).unwrap_err());
    assert_eq!(op, "from_binary");
    assert!(message.contains("shared memory is off"), "{message}");
    w.upload_f32(2, &[2], &[1.0, 2.0]);
    let (info, payload) = call(&mut w, 2, "to_binary", &[10], &[2], pin(1)).unwrap();
    assert!(info.get("address").is_none());
    assert_eq!(payload.len(), 8);
    w.close(Duration::from_secs(1));
}

#[test]
fn a_pipe_upload_whose_sender_died_between_chunks_is_dropped_by_its_release() {
    let mut w = Worker::start(&["--chunk-bytes", "1048576"]);
    let attrs = tensor_attrs(&[4 << 20], "u", 8, 4 * MIB);
    w.send(request(0, 3, "from_binary", &[1], &[], attrs), &vec![1u8; MIB]);
    w.send(
        request(0, 3, "upload", &[1], &[], Term::int(MIB as u64)),
        &vec![2u8; MIB],
    );
    assert_eq!(active(&mut w, 1), 4 * MIB, "the whole buffer waits for the rest");
    // The sender is gone; its handle's release is what comes next.
    w.request(0, "release", &[], &[1], nil());
    assert_eq!(active(&mut w, 2), 0);
    // Nothing of it is left: the id can be defined afresh.
    w.upload_f32(1, &[1], &[7.0]);
    assert_eq!(w.read_f32(3, 1), vec![7.0]);
    w.close(Duration::from_secs(1));
}

#[test]
fn upload_frames_sent_as_calls_are_refused_at_once() {
    let mut w = Worker::start(&["--chunk-bytes", "1048576"]);
    let attrs = tensor_attrs(&[2 << 20], "u", 8, 2 * MIB);
    // A first chunk with a seq: answered now, not after chunks that may never come.
    w.send(request(5, 3, "from_binary", &[1], &[], attrs.clone()), &vec![1u8; MIB]);
    let (reply, _) = w.recv();
    assert_eq!(reply.as_tuple().unwrap()[1], Term::int(5));
    let (op, message) = error_parts(&reply);
    assert_eq!(op, "from_binary");
    assert!(
        message.contains("from_binary is fire-and-forget: send it with seq 0"),
        "{message}"
    );
    assert_eq!(
        error_parts(&w.read(6, 1).unwrap_err()).0,
        "from_binary",
        "its id is poisoned"
    );
    // A later chunk with a seq: refused, and the upload it belonged to is dropped.
    w.send(request(0, 3, "from_binary", &[2], &[], attrs), &vec![1u8; MIB]);
    w.send(
        request(7, 3, "upload", &[2], &[], Term::int(MIB as u64)),
        &vec![2u8; MIB],
    );
    let (op, message) = error_parts(&w.recv().0);
    assert_eq!(op, "upload");
    assert!(message.contains("upload is fire-and-forget"), "{message}");
    assert_eq!(active(&mut w, 8), 0, "the partial upload is gone");
    // A single-frame upload with a seq is refused the same way.
    let header = request(9, 3, "from_binary", &[3], &[], tensor_attrs(&[1], "f", 32, 4));
    w.send(header, &[0; 4]);
    assert_eq!(error_parts(&w.recv().0).0, "from_binary");
    w.close(Duration::from_secs(1));
}

#[test]
fn a_released_uploads_file_is_cached_for_the_next_upload_of_its_size() {
    let mut w = Worker::start(&[]);
    let why = "an upload is copied to the card, not kept in its file, so a later upload of the size is not given the same file";
    if w.skip_on_gpu("a_released_uploads_file_is_cached_for_the_next_upload_of_its_size", why) {
        return;
    }
    let cache = |w: &mut Worker, seq| int(&call(w, seq, "memory_info", &[], &[], nil()).unwrap().0, "cache") as usize;
    let attrs = || tensor_attrs(&[MIB as i32], "u", 8, MIB);
    let (first, _) = call(&mut w, 1, "upload_file", &[1], &[], attrs()).unwrap();
    fill(&first, &pattern(MIB));
    w.request(0, "from_file", &[1], &[], nil());
    call(&mut w, 20, "clear_cache", &[], &[], nil()).unwrap();
    w.request(0, "release", &[], &[1], nil());
    assert_eq!(cache(&mut w, 2), MIB);
    assert_eq!(active(&mut w, 3), 0);
    let (second, _) = call(&mut w, 4, "upload_file", &[2], &[], attrs()).unwrap();
    assert_eq!(
        int(&second, "inode"),
        int(&first, "inode"),
        "the same file, its pages in place"
    );
    assert_eq!(cache(&mut w, 5), 0);
    fill(&second, &vec![9u8; MIB]);
    w.request(0, "from_file", &[2], &[], nil());
    assert_eq!(w.read(6, 2).unwrap().1, vec![9u8; MIB]);
    // Another size makes a new file; clear_cache closes the cached ones.
    w.request(0, "release", &[], &[2], nil());
    call(&mut w, 7, "upload_file", &[3], &[], tensor_attrs(&[4096], "u", 8, 4096)).unwrap();
    assert_eq!(cache(&mut w, 8), MIB);
    call(&mut w, 9, "clear_cache", &[], &[], nil()).unwrap();
    assert_eq!(cache(&mut w, 10), 0);
    let open = std::fs::read_dir(format!("/proc/{}/fd", w.pid())).unwrap().filter(|e| {
        std::fs::read_link(e.as_ref().unwrap().path())
            .unwrap()
            .to_string_lossy()
            .contains("moat-upload")
    });
    assert_eq!(open.count(), 1, "only the staged file of id 3 is open");
    // A cache limit below a file's size keeps nothing.
    call(&mut w, 11, "set_cache_limit", &[], &[], Term::int(1024u64)).unwrap();
    w.request(0, "from_file", &[3], &[], nil());
    w.request(0, "release", &[], &[3], nil());
    assert_eq!(cache(&mut w, 12), 0);
    w.close(Duration::from_secs(1));
}
