#!/usr/bin/env python3
"""The command-line discipline of every `kvstage` command (CTest's cli/test_cli).

Spawns the built tool (--tool) in a session of its own for each case and checks:
- bad values: every command and subcommand (read from `kvstage --help` and `kvstage bench
  --help`, plus llm-rank and demo's inproc mode) x every class of bad value (zero where a range
  starts at 1, below and above a declared range, negative, overflowing, non-numeric, trailing
  garbage, not finite, unknown choice, empty, missing value, unknown flag, stray argument, a
  value for a flag that takes none) and the impossible combinations of the table below: exit 2,
  stderr exactly one line that starts with "error:" and names the flag, back quickly, and no
  process of the session left (nothing was started);
- `kvstage --version` and `kvstage version`: the CMake version (--version), a commit, the
  protocol version;
- a port in use: serve and router say "error: port P on HOST is in use" and exit 2;
- the decode server's bootstrap wait ends at --startup-timeout-s;
- `kvstage sim`'s verdict line: PASS, or FAIL naming what did not hold;
- the router's --servers-file: a bad line is a usage error naming it, and SIGHUP re-reads it
  (the servers /metrics lists follow the file);
- help and README agree: every flag the README names for a command is in that command's
  --help, the bench list is the same in `kvstage --help`, `kvstage bench --help` and the README.
Every flag of every --help is exercised, so a flag without a range check shows up here too.
"""
import argparse
import concurrent.futures
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

QUICK_S = 6.0  # a usage error answers well within this (a model load takes longer), on a busy CI machine too
SEEDED = "2,64,128,4,2,16,300"  # 4 query heads, 2 KV heads, ffn 128: TP 1, 2 or 4

failures = []


def fail(what):
    failures.append(what)
    print("FAIL: " + what, file=sys.stderr)


def session_left(sid):
    """Pids still in session sid (the tool's: it leads its own)."""
    left = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(rest[3]) == sid and rest[0] != "Z":
            left.append(int(d))
    return left


def run(tool, args, timeout=10.0):
    """(rc, stdout, stderr, seconds, pids left in its session); rc None on a timeout."""
    t0 = time.monotonic()
    p = subprocess.Popen([tool] + args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        rc = None
    secs = time.monotonic() - t0
    left = session_left(p.pid)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return rc, out, err, secs, left


def expect_usage_error(tool, args, flag=None, accepted=None):
    rc, out, err, secs, left = run(tool, args)
    what = "kvstage " + " ".join(args)
    lines = err.splitlines()
    if out.strip():
        fail("%s: printed %r on stdout before refusing" % (what, out[:200]))
    if rc != 2:
        fail("%s: exit %s, want 2 (stderr: %r)" % (what, rc, err[-300:]))
    elif len(lines) != 1 or not lines[0].startswith("error: "):
        fail("%s: stderr is not one 'error:' line: %r" % (what, err[-600:]))
    elif flag is not None and flag not in lines[0]:
        fail("%s: the error does not name %s: %r" % (what, flag, lines[0]))
    elif accepted is not None and accepted not in lines[0]:
        fail("%s: the error does not say %r: %r" % (what, accepted, lines[0]))
    if secs > QUICK_S:
        fail("%s: took %.1f s: something started" % (what, secs))
    if left:
        fail("%s: left processes %s" % (what, left))


# ---- the commands and their flags, from --help ----

FLAG_LINE = re.compile(r"^  --([a-z0-9][a-z0-9-]*)(?: (\S+))?\s+(.*)$")
RANGE = re.compile(r"; in ([\[(])([-0-9.e+]+),([-0-9.e+]+)([\])])$")


def help_of(tool, cmd):
    rc, out, err, _, _ = run(tool, cmd + ["--help"])
    if rc != 0:
        fail("kvstage %s --help: exit %s (%r)" % (" ".join(cmd), rc, err[-300:]))
    return out


def table_names(text):
    """The names of a dispatcher's --help table: "  name   summary" lines."""
    return [m.group(1) for m in re.finditer(r"^  ([a-z][a-z0-9-]*) +\S", text, re.M)]


def flags_of(help_text):
    """[(name, kind, lo, hi, lo_open, hi_open)] of a command's --help; kind N X S FLAG CHOICE:a|b."""
    flags = []
    for line in help_text.splitlines():
        m = FLAG_LINE.match(line)
        if not m or m.group(1) == "help":
            continue
        val = m.group(2) or "FLAG"
        if val not in ("N", "X", "S", "FLAG"):
            val = "CHOICE:" + val
        r = RANGE.search(m.group(3))
        if r:
            flags.append((m.group(1), val, r.group(2), r.group(3), r.group(1) == "(", r.group(4) == ")"))
        else:
            flags.append((m.group(1), val, None, None, False, False))
    return flags


GENERIC_INT = ["abc", "-1", "7x", "99999999999999999999999", "1.5", ""]
GENERIC_DOUBLE = ["abc", "1x", "nan", "inf", ""]


def bad_values(kind, lo, hi, lo_open, hi_open, k):
    """Values of a flag that must be refused: its range's edges, and the k-th generic class."""
    vals = []
    if kind == "N":
        if lo is not None:
            lo_i, hi_i = int(lo), int(hi)
            if lo_open:
                vals.append(str(lo_i))
            elif lo_i > 0:
                vals.append(str(lo_i - 1))
            if hi_i < 2**64 - 1:
                vals.append(str(hi_i + 1 if not hi_open else hi_i))
        vals.append(GENERIC_INT[k % len(GENERIC_INT)])
    elif kind == "X":
        if lo is not None:
            vals.append(lo if lo_open else repr(float(lo) - 1))
            vals.append(hi if hi_open else repr(float(hi) + 1))
        vals.append(GENERIC_DOUBLE[k % len(GENERIC_DOUBLE)])
    elif kind.startswith("CHOICE:"):
        vals.append("no-such-choice")
    elif kind == "S":
        vals.append("")
    return vals


def flag_cases(cmd, flags):
    """(args, flag) usage errors for every flag of cmd, and the classes shared by all flags."""
    cases = []
    for k, (name, kind, lo, hi, lo_open, hi_open) in enumerate(flags):
        flag = "--" + name
        if kind == "FLAG":
            cases.append((cmd + [flag + "=1"], flag))
            continue
        if kind == "S" and name in ("prompt",):
            continue
        for v in bad_values(kind, lo, hi, lo_open, hi_open, k):
            cases.append((cmd + [flag, v], flag))
        cases.append((cmd + [flag], flag))  # missing value
    nums = [f for f in flags if f[1] == "N"]
    if nums:
        flag = "--" + nums[0][0]
        for v in GENERIC_INT:
            cases.append((cmd + [flag + "=" + v], flag))
    cases.append((cmd + ["--no-such-flag"], "--no-such-flag"))
    cases.append((cmd + ["--no-such-flag=3"], "--no-such-flag"))
    cases.append((cmd + ["stray"], "stray"))
    return cases


# ---- impossible combinations and missing requirements ----

def combo_cases(have_model):
    c = [
        ([], None, None),
        (["no-such-command"], "no-such-command", "plan|"),
        (["bench", "no-such-bench"], "no-such-bench", "radix|"),
        (["version", "extra"], "extra", None),
        (["plan", "--decode-tp", "3"], "--decode-tp", "1, 2, 4, 8"),
        (["plan", "--mla", "--head-dim-v", "4"], "--mla", None),
        (["plan", "--page-size", "16", "--prefill-page-size", "8"], "--page-size", None),
        (["plan", "--decode-page-size", "64", "--chunk", "96"], "--chunk", "multiple of the decode page"),
        (["sim", "--prefill-tp", "3"], "--prefill-tp", "1, 2, 4, 8"),
        (["sim", "--ring-bytes", "4096", "--ring-slots", "4"], "--ring-slots", None),
        (["sim", "--layout", "nhd", "--decode-layout", "hnd"], "--layout", None),
        (["sim", "--page-size", "16", "--decode-page-size", "8"], "--page-size", None),
        (["sim", "--prefill-pp", "5", "--layers", "4"], "--prefill-pp", "one stage per layer"),
        (["sim", "--decode-page-size", "64", "--chunk", "96"], "--chunk", "multiple of the decode page"),
        (["demo", "--prefill-pp", "17"], "--prefill-pp", "64 prefill ranks"),
        (["plan", "--prefill-pp", "9", "--layers", "8"], "--prefill-pp", None),
        (["plan", "--decode-dcp", "2"], "--decode-dcp", "holds each head on 1"),
        (["plan", "--mla", "--decode-tp", "4", "--decode-dcp", "3"], "--decode-dcp", "does not divide decode TP 4"),
        (["sim", "--mla", "--decode-tp", "4", "--decode-dcp", "4", "--dcp-interleave", "3"], "--dcp-interleave", "divide the decode page size 16"),
        (["sim", "--mla", "--decode-tp", "4", "--decode-dcp", "4", "--chunk", "32"], "--chunk", "decode DCP 4 x decode page size 16 = 64"),
        (["demo", "--decode-dcp", "65"], "--decode-dcp", None),
        (["sim", "--faults", "reorder,bogus"], "--faults", None),
        (["sim", "--prefix-len", "3000"], "--prefix-len", None),
        (["sim", "--gpus", "0,1"], "--gpus", None),
        (["sim", "--pool-pages", "1"], "pool", None),
        (["demo", "--prefill-tp", "3"], "--prefill-tp", "1, 2, 4, 8"),
        (["demo", "--workload", "shared-prefix", "--prefix-len", "2000"], "--prefix-len", None),
        (["demo", "--gpus", "0,1"], "--gpus", None),
        (["demo", "--page-size", "16", "--prefill-page-size", "8"], "--page-size", None),
        (["demo", "--rank", "1"], "--rank", None),
        (["demo", "--transport"], "--transport", None),
        (["demo", "--transport", "carrier-pigeon"], "--transport", "ucx|inproc"),
        (["demo", "--data", "tcp", "--write-mode", "direct"], "--write-mode", "staged with --data tcp"),
        (["sim", "--write-mode", "direct"], "--write-mode", "direct with --device cuda"),
        (["sim", "--device", "cuda", "--prefill-page-size", "8"], None, "page size (16) to divide the prefill page size (8)"),
        (["demo", "--device", "cuda", "--prefill-page-size", "32"], None, "page size (32) to divide the decode page size (16)"),
        (["sim", "--device", "cuda", "--decode-tp", "4", "--kv-heads", "2", "--decode-dcp", "2", "--chunk", "512"], None, "cannot run decode context parallelism"),
        (["prefill", "--decode-tp", "3"], "--decode-tp", None),
        (["serve", "--seeded", SEEDED, "--tp", "3"], "--tp", "accepted: 1, 2, 4 ("),
        (["serve", "--seeded", SEEDED, "--role", "prefill", "--peer-tp", "3"], "--peer-tp", "1, 2, 4"),
        (["serve", "--seeded", "1,2,3"], "--seeded", None),
        (["serve", "--seeded", "2,64,128,4,2,16,100"], "--seeded", "257"),
        (["serve", "--seeded", SEEDED, "--model", "x.gguf"], "--seeded", None),
        (["serve", "--role", "decode", "--seeded", SEEDED, "--peer-tp", "2"], "--peer-tp", "--bootstrap"),
        (["serve", "--role", "decode", "--seeded", SEEDED, "--bootstrap", "tcp://127.0.0.1:5",
          "--max-peer-instances", "2"], "--max-peer-instances", "no --bootstrap"),
        (["serve", "--seeded", SEEDED, "--peer-idle-s", "5"], "--peer-idle-s", "--role decode"),
        (["serve", "--role", "decode", "--bootstrap", "localhost:5"], "--bootstrap", "tcp://"),
        (["serve", "--seeded", SEEDED, "--bootstrap", "tcp://127.0.0.1:5"], "--bootstrap", None),
        (["serve", "--seeded", SEEDED, "--registry", "tcp://127.0.0.1:5"], "--registry", None),
        (["serve", "--seeded", SEEDED, "--peer-tp", "2"], "--peer-tp", None),
        (["serve", "--seeded", SEEDED, "--host", "localhost"], "--host", None),
        (["serve", "--seeded", SEEDED, "--max-model-len", "5000"], "--max-model-len", "[2,4096]"),
        (["serve", "--seeded", SEEDED, "--kv-tokens", "100"], "--kv-tokens", "[4096,"),
        (["bench", "serve", "--prefill-tp", "2"], "--prefill-tp", "accepted: 1, 3 ("),
        (["bench", "serve", "--decode-tp", "4"], "--decode-tp", "accepted: 1, 3 ("),
        (["router"], "--prefill", None),
        (["router", "--prefill", "http://127.0.0.1:1"], "--decode", None),
        (["router", "--prefill", "ftp://x", "--decode", "http://127.0.0.1:2"], "--prefill", None),
        (["router", "--prefill", "http://127.0.0.1:1", "--decode"], "--decode", None),
        (["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
          "--host", "256.1.1.1"], "--host", None),
        (["generate"], "--prompt", None),
        (["generate", "--prompt"], "--prompt", None),
        (["generate", "--prompt-ids", "1,x", "--seeded", SEEDED], "--prompt-ids", None),
        (["generate", "--prompt-ids", "1,400", "--seeded", SEEDED], "--prompt-ids", "vocabulary"),
        (["generate", "--prompt-ids", "1,2", "--seeded", SEEDED, "--prefill-tp", "3"], "--prefill-tp", "1, 2, 4"),
        (["generate", "--prompt-ids", "1,2", "--seeded", SEEDED, "--colocated", "--tp", "3"], "--tp", None),
        (["generate", "--prompt-ids", "1,2", "--seeded", SEEDED, "--tp", "2"], "--tp", None),
        (["generate", "--prompt", "hi", "--seeded", SEEDED], "--prompt", None),
        (["generate", "--prompt-ids", "1,2", "--seeded", SEEDED, "--chat"], "--chat", None),
        (["generate", "--prompt-ids", "1,2", "--seeded", SEEDED, "--max-tokens", "5000"], "--max-tokens", None),
        (["llm-rank", "--rank", "2"], "--rank", None),
        (["llm-rank", "--role", "prefill", "--seeded", SEEDED], "--registry", None),
        (["llm-rank", "--prefill-tp", "2", "--seeded", SEEDED], "--group", None),
        (["llm-rank", "--chunk", "64", "--batch-tokens", "8"], "--batch-tokens", None),
        (["bench", "radix", "--trace", "t.txt", "--seed", "3"], "--trace", None),
        (["bench", "serve", "--concurrency", "1,0"], "--concurrency", None),
        (["bench", "protocol", "--decode-tp", "3"], "--decode-tp", "1, 2, 4, 8"),
        (["bench", "transfer", "--tokens", "0"], "--tokens", None),
        (["bench", "transfer", "--tp", "2-1"], "--tp", None),
        (["bench", "transfer", "--gpus", "0"], "--gpus", None),
    ]
    if have_model:  # SmolLM2-135M: 9 query heads, 3 KV heads
        c += [
            (["serve", "--tp", "2"], "--tp", "accepted: 1, 3 ("),
            (["generate", "--prompt", "hi", "--decode-tp", "2"], "--decode-tp", "accepted: 1, 3 ("),
            (["serve-demo", "--prefill-tp", "2"], "--prefill-tp", "accepted: 1, 3 ("),
        ]
    return c


# ---- the other checks ----

def check_version(tool, version):
    pat = re.compile(r"^kvstage %s \(git ([0-9a-f]{7,40}|unknown), protocol \d+\)$" % re.escape(version))
    outs = []
    for args in (["--version"], ["version"]):
        rc, out, err, _, _ = run(tool, args)
        outs.append(out)
        if rc != 0 or not pat.match(out.strip()) or err:
            fail("kvstage %s: exit %s, %r, stderr %r" % (args[0], rc, out, err))
    if outs[0] != outs[1]:
        fail("kvstage --version and kvstage version differ: %r %r" % tuple(outs))


def check_port_in_use(tool):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port = s.getsockname()[1]
    want = "error: port %d on 127.0.0.1 is in use" % port
    for args in (["serve", "--seeded", SEEDED, "--port", str(port)],
                 ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                  "--port", str(port)]):
        rc, _, err, secs, left = run(tool, args)
        lines = err.splitlines()
        if rc != 2 or len(lines) != 1 or not lines[0].startswith(want) or secs > QUICK_S or left:
            fail("kvstage %s with the port taken: exit %s, %r, %.1f s, left %s" % (args[0], rc, err, secs, left))
    s.close()


def check_bootstrap_timeout(tool):
    """Nothing answers at the bootstrap endpoint: the wait ends at --startup-timeout-s (it was
    a fixed 30 s)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))  # reserved, never listening: connections are refused
    port = s.getsockname()[1]
    args = ["serve", "--role", "decode", "--seeded", SEEDED, "--bootstrap",
            "tcp://127.0.0.1:%d" % port, "--startup-timeout-s", "2"]
    rc, _, err, secs, left = run(tool, args, timeout=20)
    if rc != 1 or "within 2 s" not in err or not (1.5 <= secs <= 8) or left:
        fail("decode server with no prefill instance, --startup-timeout-s 2: exit %s after %.1f s, "
             "left %s, %r" % (rc, secs, left, err[-300:]))
    s.close()


def check_sim_verdict(tool):
    """`kvstage sim`'s last line is its verdict: PASS, or FAIL saying which check did not hold.
    The corruption fault with checksums off lets flipped bits land unseen, so the run fails on
    the bytes and says why."""
    small = ["sim", "--kv-heads", "2", "--prefill-tp", "1", "--decode-tp", "2", "--layers", "2",
             "--prompt-len", "200", "--prefix-len", "50", "--requests", "20", "--faults", "corrupt"]
    rc, out, err, _, _ = run(tool, small + ["--seed", "2"], timeout=30)
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if rc != 0 or not last.startswith("PASS:"):
        fail("sim under the corruption fault: exit %s, last line %r, %r" % (rc, last, err[-300:]))
    rc, out, err, _, _ = run(tool, small + ["--seed", "2", "--checksum", "off"], timeout=30)
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if rc != 1 or not re.match(r"FAIL: [1-9]\d* bytes .* differ in rooms that succeeded \(.*--checksum off\)$", last):
        fail("sim under the corruption fault with --checksum off: exit %s, last line %r" % (rc, last))


def servers_file(text):
    f = tempfile.NamedTemporaryFile("w", prefix="kvs-servers-", suffix=".txt", delete=False)
    f.write(text)
    f.close()
    return f.name


def check_servers_file(tool):
    """A bad line is one usage error naming the flag and the line; SIGHUP applies a new file."""
    bad = servers_file("prefill http://127.0.0.1:1\ndecode ftp://x\n")
    expect_usage_error(tool, ["router", "--servers-file", bad], "--servers-file", "line 2")
    one_side = servers_file("# no decode server\nprefill http://127.0.0.1:1\n")
    expect_usage_error(tool, ["router", "--servers-file", one_side], "--servers-file", "decode")
    path = servers_file("prefill http://127.0.0.1:1\ndecode http://127.0.0.1:2\n")
    p = subprocess.Popen([tool, "router", "--servers-file", path, "--health-interval-ms", "100"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, start_new_session=True, text=True)
    try:
        line = p.stdout.readline()
        m = re.search(r"routing on (http://[0-9.]+:\d+)", line)
        if not m:
            fail("router --servers-file: no 'routing on' line: %r" % line)
            return
        def servers():
            text = urllib.request.urlopen(m.group(1) + "/metrics", timeout=5).read().decode()
            return set(re.findall(r'kvstage_router_server_up\{side="(\w+)",url="([^"]+)"\}', text))
        want = {("prefill", "http://127.0.0.1:1"), ("decode", "http://127.0.0.1:2")}
        if servers() != want:
            fail("router --servers-file: /metrics lists %s, want %s" % (servers(), want))
        with open(path, "w") as f:
            f.write("prefill http://127.0.0.1:1\ndecode http://127.0.0.1:3\n")
        os.kill(p.pid, signal.SIGHUP)
        want = {("prefill", "http://127.0.0.1:1"), ("decode", "http://127.0.0.1:3")}
        end = time.monotonic() + 5
        while servers() != want and time.monotonic() < end:
            time.sleep(0.05)
        if servers() != want:
            fail("router after SIGHUP: /metrics lists %s, want %s" % (servers(), want))
        p.send_signal(signal.SIGTERM)
        if p.wait(timeout=10) != 0:
            fail("router --servers-file: exit %s after SIGTERM" % p.returncode)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for f in (bad, one_side, path):
            os.unlink(f)


def check_readme(tool, readme, helps, benches):
    text = open(readme).read()
    # The tool table: "| `kvstage X` | ... |" rows, a row may name two commands.
    for m in re.finditer(r"^\| ((?:`kvstage [^`]+`(?:, )?)+) \| (.*) \|$", text, re.M):
        cmds = re.findall(r"`kvstage ([^`]+)`", m.group(1))
        flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", m.group(2)))
        for cmd in cmds:
            h = helps.get(cmd)
            if h is None:
                fail("README names `kvstage %s`, which the tool does not have" % cmd)
                continue
            for f in flags:
                if not re.search(r"(?<![\w-])%s(?![\w-])" % re.escape(f), h):
                    fail("README says `kvstage %s` takes %s; its --help does not" % (cmd, f))
    # Command lines: "./build/kvstage X ..." in code blocks and in the text.
    for m in re.finditer(r"\./build/kvstage ([a-z-]+)((?: [a-z]+)?)([^`\n]*)", text):
        cmd = m.group(1) + (m.group(2) if m.group(1) == "bench" else "")
        rest = m.group(3) if m.group(1) == "bench" else m.group(2) + m.group(3)
        rest = rest.split("#")[0]
        h = helps.get(cmd)
        if h is None:
            fail("README runs `kvstage %s`, which the tool does not have" % cmd)
            continue
        for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest):
            if not re.search(r"(?<![\w-])%s(?![\w-])" % re.escape(f), h):
                fail("README runs `kvstage %s %s`; its --help has no %s" % (cmd, f, f))
    readme_benches = re.findall(r"^\| `kvstage bench ([a-z]+)` \|", text, re.M)
    if sorted(readme_benches) != sorted(benches):
        fail("README's benchmarks %s differ from `kvstage bench --help`'s %s" % (readme_benches, benches))
    top = helps[""]
    m = re.search(r"^  bench\s+.*\(([^)]*)\)", top, re.M)
    listed = [b.strip() for b in m.group(1).split(",")] if m else []
    if sorted(listed) != sorted(benches):
        fail("`kvstage --help` lists the benchmarks %s, `kvstage bench --help` %s" % (listed, benches))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", required=True)
    ap.add_argument("--version", required=True)
    ap.add_argument("--readme", required=True)
    a = ap.parse_args()
    tool = a.tool
    t0 = time.monotonic()

    top = help_of(tool, [])
    commands = [c for c in table_names(top)]
    bench_help = help_of(tool, ["bench"])
    benches = table_names(bench_help)
    helps = {"": top, "bench": bench_help}
    cmd_lists = [[c] for c in commands if c not in ("bench", "version")]
    cmd_lists += [["bench", b] for b in benches] + [["llm-rank"], ["demo", "--transport", "inproc"]]
    cases = []
    for cmd in cmd_lists:
        h = help_of(tool, cmd)
        key = " ".join(cmd[:2]) if cmd[0] == "bench" else cmd[0]
        if cmd[0] == "demo" and len(cmd) > 1:
            helps["demo"] = helps.get("demo", "") + h
        else:
            helps[key] = helps.get(key, "") + h
        flags = flags_of(h)
        if not flags and "needs a CUDA build" in h:
            continue  # bench kernels without CUDA: it runs nothing at all
        if not flags:
            fail("kvstage %s --help lists no flags" % " ".join(cmd))
        cases += [(args, flag, None) for args, flag in flag_cases(cmd, flags)]
    have_model = run(tool, ["serve", "--tp", "2"])[2].find("cannot open the model") < 0
    cases += combo_cases(have_model)

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as ex:
        list(ex.map(lambda c: expect_usage_error(tool, *c), cases))
    check_version(tool, a.version)
    check_port_in_use(tool)
    check_bootstrap_timeout(tool)
    check_servers_file(tool)
    check_sim_verdict(tool)
    check_readme(tool, a.readme, helps, benches)
    print("%d usage-error cases over %d commands, %d failures, %.1f s" %
          (len(cases), len(cmd_lists), len(failures), time.monotonic() - t0))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
