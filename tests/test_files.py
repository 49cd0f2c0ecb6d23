"""Output files are written whole or not at all, never through a name another user chose, and
never over a device, a FIFO or a link (memadvisor/files.py). The CLI's writer, Plan.to_json
and Plan.to_html are that one writer."""

from __future__ import annotations

import errno
import multiprocessing
import os
import socket
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from memadvisor import files
from memadvisor.cli._app import check_output_paths, write_text
from memadvisor.errors import BadInputError
from memadvisor.files import check_writable, write_text_atomic
from tests.fixtures.other_user import as_nobody, folder_nobody_can_read_only, nobody_env

ROOT = Path(__file__).resolve().parents[1]
GPT_PLAN = ROOT / "tests" / "report" / "_gpt_plan.py"
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="chown of a symlink needs root")


def _writers():
    """Each public way to write a file, as f(path, text)."""
    return {
        "cli": lambda path, text: write_text(path, text, "the plan", quiet=True),
        "files": lambda path, text: write_text_atomic(path, text, "the plan"),
    }


@pytest.mark.parametrize("writer", ["cli", "files"])
def test_a_symlink_planted_at_the_old_temporary_name_is_never_followed(
    tmp_path: Path, writer: str
) -> None:
    """The temporary file is made with exclusive create under an unpredictable name: a link
    another user planted at '.plan.json.partial' (the name memadvisor used to write) leaves
    the file it points to untouched."""
    victim = tmp_path / "victim"
    victim.write_text("root's own file\n")
    (tmp_path / ".plan.json.partial").symlink_to(victim)
    _writers()[writer](tmp_path / "plan.json", '{"batch_size": 8}\n')
    assert victim.read_text() == "root's own file\n"
    assert (tmp_path / "plan.json").read_text() == '{"batch_size": 8}\n'
    assert not (tmp_path / "plan.json").is_symlink()


@pytest.mark.parametrize("writer", ["cli", "files"])
def test_a_file_precreated_at_the_old_temporary_name_does_not_become_the_output(
    tmp_path: Path, writer: str
) -> None:
    """A world-writable file pre-created at the old temporary name would be renamed over the
    output (its owner could then edit the plan): the output is a new file instead."""
    planted = tmp_path / ".plan.json.partial"
    planted.write_text("")
    planted.chmod(0o666)
    inode = planted.stat().st_ino
    _writers()[writer](tmp_path / "plan.json", "plan\n")
    out = (tmp_path / "plan.json").stat()
    assert out.st_ino != inode and stat.S_IMODE(out.st_mode) != 0o666


def test_the_new_file_has_the_mode_the_umask_gives(tmp_path: Path) -> None:
    """mkstemp's 0600 is only while writing: the file ends as open(path, 'w') would make it."""
    old = os.umask(0o027)
    try:
        write_text_atomic(tmp_path / "plan.json", "x", "the plan")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "plan.json").stat().st_mode) == 0o640


@pytest.mark.parametrize("writer", ["cli", "files"])
def test_a_fifo_is_written_through_not_replaced(tmp_path: Path, writer: str) -> None:
    """A FIFO (``--json`` into a reader's pipe) gets the bytes as they are and stays a FIFO:
    no temporary file, nothing replaced."""
    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    _writers()[writer](fifo, "x")
    reader.join(timeout=10)
    assert got == [b"x"]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]  # no temporary left


def private_null_device(folder: Path) -> Path:
    """A character device (the null device's numbers) in ``folder``, never the machine's own
    /dev/null: code with the bug under test replaces the node it is given (it did, as root)."""
    node = folder / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, AttributeError):
        pytest.skip("making a device node needs root (the FIFO tests cover a non-regular file)")
    return node


def test_a_device_node_is_written_through_before_and_at_the_write(tmp_path: Path) -> None:
    """A character device passes the early check, is written through, and stays one (before
    this rule, as root, memadvisor replaced the node with a regular file)."""
    node = private_null_device(tmp_path)
    check_output_paths(html=node)
    write_text_atomic(node, "x", "the HTML report")
    assert stat.S_ISCHR(os.lstat(node).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["null"]


def test_dev_stdout_through_its_links_is_written_through(tmp_path: Path) -> None:
    """/dev/stdout -> /proc/self/fd/1 -> a pipe with no path: reached through the link."""
    code = (
        "from memadvisor.files import write_text_atomic; "
        "write_text_atomic('/dev/stdout', 'plan', 'the plan')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "plan"


def test_a_socket_or_a_folder_is_refused(tmp_path: Path) -> None:
    """What is neither a file nor a stream is refused, naming what it is."""
    with pytest.raises(BadInputError, match="a folder"):
        write_text_atomic(tmp_path, "x", "the plan")
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(tmp_path / "s"))
        with pytest.raises(BadInputError, match="a socket"):
            write_text_atomic(tmp_path / "s", "x", "the plan")
    finally:
        sock.close()


def test_a_symlink_to_a_regular_file_is_written_through_and_stays_a_link(tmp_path: Path) -> None:
    """The file a (own) link points to gets the content; the link itself is kept."""
    real = tmp_path / "real" / "plan.json"
    real.parent.mkdir()
    real.write_text("old")
    link = tmp_path / "plan.json"
    link.symlink_to(real)
    write_text_atomic(link, "new", "the plan")
    assert link.is_symlink() and real.read_text() == "new"


@pytest.mark.parametrize("make", ["dangling", "to_folder"])
def test_a_symlink_to_no_file_or_stream_is_refused(tmp_path: Path, make: str) -> None:
    link = tmp_path / "plan.json"
    if make == "dangling":
        link.symlink_to(tmp_path / "missing")
    else:
        (tmp_path / "folder").mkdir()
        link.symlink_to(tmp_path / "folder")
    with pytest.raises(BadInputError, match="symlink to"):
        write_text_atomic(link, "x", "the plan")
    assert link.is_symlink()


@root_only
def test_a_symlink_owned_by_another_user_is_refused_as_root(tmp_path: Path) -> None:
    """Run as root, memadvisor does not follow another user's link into a root-only file."""
    secret = tmp_path / "secret"
    secret.write_text("root only")
    secret.chmod(0o600)
    link = tmp_path / "plan.json"
    link.symlink_to(secret)
    os.lchown(link, 65534, 65534)
    with pytest.raises(BadInputError, match="owned by another user"):
        write_text_atomic(link, "x", "the plan")
    with pytest.raises(BadInputError, match="owned by another user"):
        check_output_paths(json=link)
    assert secret.read_text() == "root only"


def test_a_failed_write_leaves_the_old_file_whole_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that fills up in the middle of the write: BadInputError, the old file as it was,
    and nothing else left in the folder."""
    path = tmp_path / "plan.json"
    path.write_text('{"old": true}\n')

    def full_disk(fd: int, data: bytes) -> None:
        os.write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files, "_write_all", full_disk)
    with pytest.raises(BadInputError, match="No space left on device.*unchanged"):
        write_text_atomic(path, '{"new": true, "padding": "' + "x" * 10_000 + '"}\n', "the plan")
    assert path.read_text() == '{"old": true}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


@pytest.mark.parametrize("method", ["to_json", "to_html"])
def test_plan_methods_keep_the_old_file_whole_when_the_write_fails(
    tmp_path: Path, method: str
) -> None:
    """Plan.to_json and to_html under a real failed write (a file-size limit, EFBIG, in a child
    process): the old file is whole, the error is memadvisor's BadInputError."""
    path = tmp_path / "out"
    path.write_text("old content\n")
    code = textwrap.dedent(
        f"""
        import importlib.util, resource, signal, sys
        spec = importlib.util.spec_from_file_location("gpt_plan", {str(GPT_PLAN)!r})
        module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
        plan = module.gpt_plan()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        from memadvisor.errors import BadInputError
        try:
            plan.{method}({str(path)!r})
        except BadInputError as e:
            print("refused:", e)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused:" in done.stdout
    assert path.read_text() == "old content\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def _hammer(path: str, tag: str, count: int) -> int:
    failures = 0
    for i in range(count):
        try:
            write_text_atomic(path, f"{tag} {i}\n" * 50, "the plan")
        except BadInputError:
            failures += 1
    return failures


def test_two_writers_to_one_path_never_fail(tmp_path: Path) -> None:
    """Two processes writing the same output at once: no write fails (they used to share the
    temporary name, and one renamed the other's away: 'No such file or directory'), and the
    file is always one writer's whole content."""
    path = str(tmp_path / "plan.json")
    with multiprocessing.get_context("fork").Pool(2) as pool:
        failures = pool.starmap(_hammer, [(path, "a", 300), (path, "b", 300)])
    assert failures == [0, 0]
    lines = Path(path).read_text().splitlines()
    assert len(lines) == 50 and len(set(lines)) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


# check_writable as the other user: exit 3 and the message when it refuses.
CHECK_AS_USER = """
import sys
from memadvisor.errors import BadInputError
from memadvisor.files import check_writable
try:
    check_writable(sys.argv[1], "--json")
except BadInputError as e:
    print(e)
    sys.exit(3)
"""


def test_the_early_check_refuses_a_folder_that_cannot_be_written(tmp_path: Path) -> None:
    """A folder without write permission fails the check before planning. Root, whom
    permissions do not stop, checks it as user nobody through setpriv."""
    if os.geteuid() != 0:
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o555)
        try:
            with pytest.raises(BadInputError, match="not writable"):
                check_writable(folder / "plan.json", "--json")
        finally:
            folder.chmod(0o755)
        return
    prefix = as_nobody()
    with folder_nobody_can_read_only() as folder:
        done = subprocess.run(
            [*prefix, sys.executable, "-c", CHECK_AS_USER, str(folder / "plan.json")],
            env=nobody_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert list(folder.iterdir()) == []
    assert done.returncode == 3, (done.stdout, done.stderr[-3000:])
    assert "not writable" in done.stdout and "Permission denied" in done.stdout


def test_the_early_check_leaves_nothing_behind(tmp_path: Path) -> None:
    assert check_writable(tmp_path / "plan.json", "--json") == tmp_path / "plan.json"
    assert list(tmp_path.iterdir()) == []
