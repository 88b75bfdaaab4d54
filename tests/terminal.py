"""A command run on a pseudo-terminal, as a user at a terminal emulator runs it: the kernel's
line discipline, Ctrl-C as a signal, readline's escape sequences."""

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import time


class Terminal:
    def __init__(self, args, columns: int = 200):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))

        def own_terminal():  # a session of its own, with the pty as its controlling terminal
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
            # Ctrl-C as at a terminal, even when the suite runs where SIGINT is ignored (a
            # shell's `cmd &` without job control), which the child would inherit.
            signal.signal(signal.SIGINT, signal.SIG_DFL)

        self.proc = subprocess.Popen(
            args,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            preexec_fn=own_terminal,
            env=dict(os.environ, TERM="xterm", PYTHONUNBUFFERED="1"),
        )
        os.close(slave)
        self.master, self.seen, self.pos = master, b"", 0

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError:  # the other end closed
            data = b""
        self.seen += data
        return bool(data)

    def expect(self, pattern: str, timeout: float = 300) -> re.Match:
        """The next match of `pattern` in what the terminal shows, after the previous one."""
        deadline = time.time() + timeout
        while True:
            match = re.search(pattern.encode(), self.seen[self.pos :])
            if match:
                self.pos += match.end()
                return match
            if time.time() > deadline or not self._read(min(1.0, max(0.0, deadline - time.time()))):
                raise AssertionError(
                    f"no {pattern!r} (exit {self.proc.poll()}); the terminal shows {self.seen[-1500:]!r}"
                )

    def type(self, text: str) -> None:
        """Keystrokes or a paste, in pieces no larger than a terminal emulator writes at once."""
        data = text.encode()
        for i in range(0, len(data), 512):
            os.write(self.master, data[i : i + 512])
            # Read the echo as it comes: a full output buffer would block the program, and then
            # its input, and then this writer.
            while select.select([self.master], [], [], 0.002)[0] and self._read(0):
                pass

    def wait(self, timeout: float = 60) -> int:
        deadline = time.time() + timeout
        while self.proc.poll() is None:
            if time.time() > deadline:
                self.proc.kill()
                raise AssertionError(f"still running; the terminal shows {self.seen[-1500:]!r}")
            self._read(0.2)
        os.close(self.master)
        return self.proc.returncode
