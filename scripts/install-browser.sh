#!/bin/sh
# The chat page's tests (tests/test_page.py) drive a real browser: Chromium from the
# distribution's packages (Playwright, a dev extra, drives it). Install it where we can, say how
# where we cannot; without it those tests are skipped with that reason.
[ "$(uname -s)" = Linux ] || exit 0
command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium > /dev/null && exit 0
fi
echo "note: Chromium not found; the chat page's browser tests will be skipped." >&2
echo "      Install it with: sudo apt-get install chromium" >&2
exit 0
