#!/usr/bin/env python3
# How long the kernel takes to tear down a killed process (docs/recovery.md "Detection and abort,
# measured"): the time from SIGKILL to (a) EOF on a socket it holds, (b) its pidfd readable, and
# (c) a process-shared robust mutex its main thread holds returning EOWNERDEAD to a waiter (the
# lifeline, src/common/lifeline.h), for a child holding MB of touched memory and THREADS idle
# threads. Usage: kill_teardown.py MB THREADS
import ctypes, mmap, os, socket, select, signal, sys, threading, time
mb = int(sys.argv[1]); threads = int(sys.argv[2])
libc = ctypes.CDLL("libc.so.6", use_errno=True)  # glibc >= 2.34: the pthread calls are in libc
shared = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED)  # survives the fork, shared with the child
mutex = ctypes.addressof((ctypes.c_char * 4096).from_buffer(shared))
attr = ctypes.create_string_buffer(64)
libc.pthread_mutexattr_init(attr)
libc.pthread_mutexattr_setpshared(attr, 1)  # PTHREAD_PROCESS_SHARED
libc.pthread_mutexattr_setrobust(attr, 1)   # PTHREAD_MUTEX_ROBUST
assert libc.pthread_mutex_init(ctypes.c_void_p(mutex), attr) == 0
a, b = socket.socketpair()
pid = os.fork()
if pid == 0:
    b.close()
    assert libc.pthread_mutex_lock(ctypes.c_void_p(mutex)) == 0  # held by the main thread
    buf = bytearray(mb << 20)
    for i in range(0, len(buf), 4096): buf[i] = 1
    for _ in range(threads): threading.Thread(target=lambda: time.sleep(100), daemon=True).start()
    a.send(b"r")
    time.sleep(100)
a.close()
b.recv(1)
pfd = os.pidfd_open(pid)
r, w = os.pipe()
got = []
def wait_lifeline():  # ctypes releases the GIL while it blocks
    got.append(libc.pthread_mutex_lock(ctypes.c_void_p(mutex)))
    os.write(w, b"x")
threading.Thread(target=wait_lifeline, daemon=True).start()
time.sleep(0.2)  # the waiter is blocked in the lock
t0 = time.monotonic()
os.kill(pid, signal.SIGKILL)
p = select.poll()
for fd in (b.fileno(), pfd, r): p.register(fd, select.POLLIN)
seen = {}
while len(seen) < 3:
    for fd, ev in p.poll():
        if fd not in seen:
            seen[fd] = (time.monotonic() - t0) * 1000; p.unregister(fd)
print(f"{mb} MB {threads} threads: lifeline {seen[r]:.2f} ms (EOWNERDEAD: {got == [130]}), "
      f"socket EOF {seen[b.fileno()]:.2f} ms, pidfd {seen[pfd]:.2f} ms")
os.waitpid(pid, 0)
