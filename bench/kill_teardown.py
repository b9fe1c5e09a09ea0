#!/usr/bin/env python3
# How long the kernel takes to tear down a killed process (docs/recovery.md "Detection and abort,
# measured"): the time from SIGKILL to (a) EOF on a socket it holds, (b) its pidfd readable, for a
# child holding MB of touched memory and THREADS idle threads. Usage: kill_teardown.py MB THREADS
import os, socket, select, signal, sys, time
mb = int(sys.argv[1]); threads = int(sys.argv[2])
a, b = socket.socketpair()
pid = os.fork()
if pid == 0:
    b.close()
    import threading
    buf = bytearray(mb << 20)
    for i in range(0, len(buf), 4096): buf[i] = 1
    for _ in range(threads): threading.Thread(target=lambda: time.sleep(100), daemon=True).start()
    a.send(b"r")
    time.sleep(100)
a.close()
b.recv(1)
pfd = os.pidfd_open(pid)
res = []
for _ in range(1):
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    p = select.poll(); p.register(b, select.POLLIN); p.register(pfd, select.POLLIN)
    seen = {}
    while len(seen) < 2:
        for fd, ev in p.poll():
            if fd not in seen:
                seen[fd] = (time.monotonic() - t0) * 1000; p.unregister(fd)
    print(f"{mb} MB {threads} threads: socket EOF {seen[b.fileno()]:.2f} ms, pidfd {seen[pfd]:.2f} ms")
os.waitpid(pid, 0)
