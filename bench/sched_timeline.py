#!/usr/bin/env python3
"""Per-phase scheduling summary of a system-wide perf trace of
bench/sched_timeline.exs (docs/latency.md, "A small readback, on the
scheduler timeline").

    perf script -i FILE.data --ns -F comm,tid,cpu,time,event,trace > FILE.txt
    python3 bench/sched_timeline.py FILE.txt

Per phase (found from the trace_marker writes, as writev's return value in a
raw_syscalls or syscalls:sys_exit_writev trace): idle time per CPU, run time
and switch-ins per thread and CPU, preemptions, spins (poll with timeout 0),
IPIs by sender and call site, each kind of write with its duration (with an
IPI sent inside it or not) and whom it woke on which CPU, and the wake-up
latency (waking to running) by woken thread, same CPU or not. Counts are per
cycle (per VM writev of the phase's most common size, or TL_N).
"""
import re, sys, statistics as st, collections as C
LINE = re.compile(r'^\s*(.+?)\s+(-?\d+)\s+\[(\d+)\]\s+([\d.]+):\s+(\S+):\s*(.*)$')
PH = ["echo", "sync", "raw_to_binary", "nx_to_binary", "add_to_binary"]
def med(xs): return st.median(xs) if xs else float('nan')
def pct(xs, p):
    if not xs: return float('nan')
    s = sorted(xs); return s[min(len(s)-1, int(round(p/100*(len(s)-1))))]
ev = []
for l in open(sys.argv[1]):
    m = LINE.match(l)
    if not m: continue
    comm, tid, cpu, t, name, rest = m.groups()
    ev.append((float(t)*1e6, int(cpu), comm.strip(), int(tid), name, rest))
# phases from the marker writes (writev returning 200+2i / 201+2i)
bounds = {}
for t, cpu, comm, tid, name, rest in ev:
    n = None
    if name == 'raw_syscalls:sys_exit' and rest.startswith('NR 20 = '):
        n = int(rest.split('= ')[1])
    elif name == 'syscalls:sys_exit_writev':
        n = int(rest.strip(), 16)
    if n is not None:
        if 200 <= n < 200 + 2*len(PH):
            i, end = divmod(n - 200, 2)
            bounds.setdefault(PH[i], [None, None])[end] = t
def beam(comm): return comm.endswith('_scheduler') or comm.endswith('_schedu')
for ph, (t0, t1) in bounds.items():
    if t0 is None or t1 is None: continue
    E = [e for e in ev if t0 <= e[0] <= t1]
    dur = t1 - t0
    enter = {}  # tid -> (t, nr, args)
    writes = C.defaultdict(list)  # (kind) -> list of dict
    cur = {}
    inwrite = {}  # tid -> record of the write in progress
    idle_since = {}; idle = C.Counter()
    on = C.defaultdict(C.Counter)  # comm -> cpu -> switch-ins
    run_since = {}; runtime = C.defaultdict(C.Counter)
    waking = {}  # woken tid -> (t, waker comm, waker cpu, target cpu)
    wake_lat = C.defaultdict(list)  # woken comm -> latencies waking->switch-in
    wake_where = C.Counter()
    polls0 = C.Counter(); preempt = C.Counter()
    ipis = C.Counter()
    for t, cpu, comm, tid, name, rest in E:
        if name == 'raw_syscalls:sys_enter':
            nr = int(rest.split()[1]); args = rest[rest.index('(')+1:-1].split(', ')
            enter[tid] = (t, nr, args)
            if nr in (1, 20):
                inwrite[tid] = {'t': t, 'comm': comm, 'cpu': cpu, 'nr': nr, 'fd': int(args[0], 16), 'cnt': int(args[2], 16), 'ipi': None, 'woke': None}
            if nr == 7 and args[2] == '0': polls0[comm] += 1
        elif name == 'raw_syscalls:sys_exit':
            nr = int(rest.split()[1])
            w = inwrite.pop(tid, None)
            if w and nr == w['nr']:
                w['d'] = t - w['t']; w['ret'] = int(rest.split('= ')[1])
                who = 'worker' if comm not in ('cat',) and not beam(comm) and 'dirty' not in comm else comm
                kind = ('beam' if beam(comm) else comm) + (' writev' if nr == 20 else ' write') + ' ' + str(w['ret']) + 'B'
                writes[kind].append(w)
        elif name == 'ipi:ipi_send_cpu':
            ipis[(comm, rest.split()[1], rest.split()[2].split('+')[0])] += 1
            if tid in inwrite: inwrite[tid]['ipi'] = rest.split()[2].split('=')[1].split('+')[0]
        elif name == 'sched:sched_waking':
            d = dict(kv.split('=') for kv in rest.split() if '=' in kv)
            waking[int(d['pid'])] = (t, comm, cpu, int(d['target_cpu']))
            if tid in inwrite: inwrite[tid]['woke'] = (d['comm'], cpu, int(d['target_cpu']))
        elif name == 'sched:sched_switch':
            pre, post = rest.split(' ==> ')
            d1 = dict(kv.split('=', 1) for kv in re.findall(r'(\w+=\S+)', pre))
            d2 = dict(kv.split('=', 1) for kv in re.findall(r'(\w+=\S+)', post))
            ppid, npid = int(d1['prev_pid']), int(d2['next_pid'])
            ncomm = post.split('next_comm=')[1].rsplit(' next_pid', 1)[0]
            pcomm = pre.split('prev_comm=')[1].rsplit(' prev_pid', 1)[0]
            if d1['prev_state'] == 'R': preempt[pcomm] += 1
            if ppid in run_since: runtime[pcomm][cpu] += t - run_since.pop(ppid)
            if npid != 0: run_since[npid] = t
            on[ncomm][cpu] += 1
            if npid == 0: idle_since[cpu] = t
            if ppid == 0 and cpu in idle_since: idle[cpu] += t - idle_since.pop(cpu)
            if npid in waking:
                tw, wcomm, wcpu, tcpu = waking.pop(npid)
                wake_lat[(ncomm, 'same cpu' if wcpu == cpu else 'cross cpu')].append(t - tw)
                wake_where[(wcomm, ncomm, 'same cpu' if wcpu == cpu else 'cross cpu')] += 1
    for cpu in idle_since: idle[cpu] += t1 - idle_since[cpu]
    nreq = max((len(v) for k, v in writes.items() if k.startswith('beam writev')), default=int(__import__('os').environ.get('TL_N', '2000')))
    print(f"\n## {ph}: {dur/1000:.1f} ms, {nreq} beam writevs of the top size (~{dur/max(nreq,1):.1f} µs per cycle)")
    print(f"idle per cpu (% of phase): " + ", ".join(f"cpu{c} {100*idle[c]/dur:.0f}%" for c in sorted(idle)))
    print("runtime per thread and cpu (µs per cycle): " + "; ".join(f"{k}: " + ", ".join(f"cpu{c} {v/nreq:.1f}" for c, v in sorted(cs.items())) for k, cs in sorted(runtime.items(), key=lambda kv: -sum(kv[1].values()))[:6]))
    print("switch-ins per thread and cpu (per cycle): " + "; ".join(f"{k}: " + ", ".join(f"cpu{c} {v/nreq:.2f}" for c, v in sorted(cs.items())) for k, cs in sorted(on.items(), key=lambda kv: -sum(kv[1].values()))[:6]))
    print("preempted (switched out runnable), per cycle: " + ", ".join(f"{k} {v/nreq:.2f}" for k, v in preempt.most_common(4)))
    print("poll(timeout 0) per cycle: " + ", ".join(f"{k} {v/nreq:.1f}" for k, v in polls0.most_common(3)))
    print("IPIs per cycle: " + ", ".join(f"{k[0]}→{k[1]} {k[2]} {v/nreq:.2f}" for k, v in ipis.most_common(5)))
    print("| write | n/cycle | median µs | p90 | with IPI | woke (same/cross cpu) |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for k, ws in sorted(writes.items(), key=lambda kv: -len(kv[1])):
        if len(ws) < nreq / 10: continue
        d = [w['d'] for w in ws]
        wi = sum(1 for w in ws if w['ipi'])
        woke = C.Counter((w['woke'][0], 'same' if w['woke'][1] == w['woke'][2] else 'cross') for w in ws if w['woke'])
        print(f"| {k} | {len(ws)/nreq:.2f} | {med(d):.2f} | {pct(d,90):.2f} | {100*wi/len(ws):.0f}% | " + ", ".join(f"{a} {b} {v/len(ws):.2f}" for (a, b), v in woke.most_common(3)) + " |")
        dw = [w['d'] for w in ws if w['ipi']]; dn = [w['d'] for w in ws if not w['ipi'] and w['woke']]; d0 = [w['d'] for w in ws if not w['woke']]
        print(f"|   of which: with IPI {med(dw):.2f} (n {len(dw)}), woke without IPI {med(dn):.2f} (n {len(dn)}), woke none {med(d0):.2f} (n {len(d0)}) | | | | | |")
    print("wake-up latency, waking → running (µs): " + "; ".join(f"{k[0]} {k[1]}: median {med(v):.1f} p90 {pct(v,90):.1f} n/cycle {len(v)/nreq:.2f}" for k, v in sorted(wake_lat.items(), key=lambda kv: -len(kv[1]))[:6]))
