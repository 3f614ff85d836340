# Can another process read CUDA managed memory (what MLX's CUDA allocator
# gives every buffer) with process_vm_readv, and through /proc/<pid>/mem?
# Decides whether GPU workers may read back as CPU ones do (Moat.Shared,
# docs/latency.md "Readbacks with process_vm_readv"). On the GPU machine:
#   python3 bench/gpu_managed_readback.py
import ctypes, ctypes.util, os, sys, glob, subprocess, time
cands = glob.glob('/usr/local/cuda*/lib64/libcudart.so*') + glob.glob(os.path.join(os.path.dirname(__import__('nvidia').__path__[0]), 'nvidia', '*', 'lib', 'libcudart.so*'))
try:
    import torch
    cands += glob.glob(os.path.join(os.path.dirname(torch.__file__), 'lib', 'libcudart*'))
except Exception as e:
    print('torch', e)
print('cudart candidates', cands[:5])
rt = ctypes.CDLL(cands[0])
libc = ctypes.CDLL(None, use_errno=True)
class iovec(ctypes.Structure):
    _fields_ = [('base', ctypes.c_void_p), ('len', ctypes.c_size_t)]
if sys.argv[1:2] == ['child']:
    pid, addr, n = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    buf = ctypes.create_string_buffer(n)
    l = iovec(ctypes.cast(buf, ctypes.c_void_p), n); r = iovec(addr, n)
    t = time.time(); got = libc.process_vm_readv(pid, ctypes.byref(l), 1, ctypes.byref(r), 1, 0); dt = time.time() - t
    print('process_vm_readv', got, 'errno', ctypes.get_errno(), 'ok' if got == n and buf.raw[:4] == b'\x5a' * 4 and buf.raw[-1:] == b'\x5a' else 'BAD', f'{n/dt/1e9:.2f} GB/s' if got == n else '')
    try:
        with open(f'/proc/{pid}/mem', 'rb', buffering=0) as f:
            f.seek(addr); t = time.time(); d = f.read(n); dt = time.time() - t
            print('/proc/pid/mem', len(d), 'ok' if d[:4] == b'\x5a' * 4 else 'BAD', f'{n/dt/1e9:.2f} GB/s')
    except Exception as e:
        print('/proc/pid/mem error', e)
    sys.exit(0)
n = 64 << 20
p = ctypes.c_void_p()
print('cudaMallocManaged', rt.cudaMallocManaged(ctypes.byref(p), ctypes.c_size_t(n), 1))
print('cudaMemset', rt.cudaMemset(p, 0x5a, ctypes.c_size_t(n)), 'sync', rt.cudaDeviceSynchronize())
for i in range(2):
    subprocess.run([sys.executable, __file__, 'child', str(os.getpid()), str(p.value), str(n)])
