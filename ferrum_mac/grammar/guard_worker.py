"""The child process of `grammar.guard`: checks the grammars it is sent under a CPU and a memory bound.

It imports nothing of ferrum's (it starts in a fraction of a second) and is run as
`python -c <this file's text> CPU_S MEMORY_MB`. Each line on stdin is a JSON list of grammars
(one request's); for each it writes one line, the engine's error (or null when it compiles),
as soon as it is known. A watchdog thread ends the process as soon as the request has used more
than CPU_S of CPU or the process grows MEMORY_MB past where it started (the engine releases the
GIL while it compiles); the kernel's CPU limit backs it up. After a request that left it big, it
ends so the next one starts small.
"""

import json
import os
import resource
import sys
import threading
import time

CPU_EXIT, MEMORY_EXIT = 3, 4
POLL_S = 0.005


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # macOS: no /proc; its ru_maxrss is the peak, in bytes
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


class Watchdog:
    def __init__(self, cpu_s: float, limit_bytes: int):
        self.cpu_s, self.limit_bytes = cpu_s, limit_bytes
        self.started: float | None = None  # process CPU time when the request began

    def watch(self) -> None:
        while True:
            started = self.started
            if started is not None and time.process_time() - started > self.cpu_s:
                os._exit(CPU_EXIT)
            if rss_bytes() > self.limit_bytes:
                os._exit(MEMORY_EXIT)
            time.sleep(POLL_S)

    def begin(self) -> None:
        used = time.process_time()
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        soft = int(used + self.cpu_s) + 2
        if hard == resource.RLIM_INFINITY or soft <= hard:
            resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
        self.started = used


def main() -> None:
    import llguidance

    cpu_s, memory_mb = float(sys.argv[1]), int(sys.argv[2])
    base = rss_bytes()
    dog = Watchdog(cpu_s, base + memory_mb * 2**20)
    threading.Thread(target=dog.watch, daemon=True).start()
    for line in sys.stdin:
        dog.begin()
        for grammar in json.loads(line):
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
            error = (messages[0] if messages else "the grammar engine rejected it") if is_error else None
            sys.stdout.write(json.dumps(error) + "\n")
            sys.stdout.flush()
        dog.started = None
        if rss_bytes() > base + memory_mb * 2**19:
            return


if __name__ == "__main__":
    main()
