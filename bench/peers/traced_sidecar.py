"""operate-sidecar with its stdio read and write timed, for ``bench/first_bench.py``.

Runs the real server (``operate_sidecar.server.__main__:main``, the same arguments) after
wrapping two functions of its stdio layer: each chunk read from stdin (``_ReadProtocol.
data_received``) and each message written to stdout (``Wire.send_bytes``, after the write)
appends one line, ``in <t>`` or ``out <t>``, to the file named by ``OPERATE_SIDECAR_BENCH_TRACE``
(``t``: ``time.perf_counter()``, the monotonic clock the bench's client reads too). From them the
bench tells the server's own time for a request (read → answer written) from the time the
request and its answer spend outside it (pipes, waking each process from idle).

Bench instrumentation only: the product has no such hook. Each line costs one ``write`` to a
regular file, the same for every request.
"""
import os
import sys
import time


def main() -> int:
    from operate_sidecar.server.rpc import stdio

    fd = os.open(os.environ["OPERATE_SIDECAR_BENCH_TRACE"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    clock, write = time.perf_counter, os.write
    read_chunk, send_bytes = stdio._ReadProtocol.data_received, stdio.Wire.send_bytes

    def data_received(self, data: bytes) -> None:
        write(fd, b"in %.7f\n" % clock())
        read_chunk(self, data)

    def send(self, body: bytes) -> None:
        send_bytes(self, body)
        write(fd, b"out %.7f\n" % clock())

    stdio._ReadProtocol.data_received = data_received
    stdio.Wire.send_bytes = send
    from operate_sidecar.server.__main__ import main as sidecar_main

    return sidecar_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
