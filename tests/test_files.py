"""Saves and the file system: temp files that touch nothing of anyone else's, the
permissions users expect, symlinks and long names as `torch.save` handles them.
See spec/SECURITY.md section 3."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from trainrec import (
    DefaultRecorder,
    NamedMpkFileRecorder,
    NamedMpkGzFileRecorder,
    RecorderError,
    TensorData,
)
from trainrec.storage import atomic as _atomic

ITEM = {"w": TensorData.from_array(np.arange(6, dtype=np.float32)), "step": 7}


def _assert_loads_item(path: Path, recorder=None) -> None:
    back = (recorder or DefaultRecorder()).load_item(path)
    assert back["step"] == 7 and back["w"].array.dtype == np.float32
    assert np.array_equal(back["w"].array, np.arange(6, dtype=np.float32))


def _temps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(_atomic.TEMP_SUFFIX))


def _new_temp_name(target: str, token: str = "0123456789ab") -> str:
    return f".{_atomic._temp_stem(target)}.{token}{_atomic.TEMP_SUFFIX}"


HOLD = textwrap.dedent(
    """
    import fcntl, os, sys
    fds = [os.open(p, os.O_RDWR | os.O_CREAT, 0o644) for p in sys.argv[1:]]
    for fd in fds:
        fcntl.flock(fd, fcntl.LOCK_EX)
    print("locked", flush=True)
    sys.stdin.readline()
    """
)


@contextlib.contextmanager
def _held_by_another_process(*paths: Path):
    """Temp files a live writer in another process holds locked, as a save does."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, *map(str, paths)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield proc
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


# -- temp-file cleanup touches only what is provably its own ------------------------------

IN_FLIGHT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from trainrec.storage.atomic import atomic_write
    with atomic_write(Path(sys.argv[1])) as f:
        f.write(b"written by the other saver")
        print("writing", flush=True)
        sys.stdin.readline()
    print("saved", flush=True)
    """
)


def test_a_save_leaves_a_concurrent_save_to_a_longer_name_alone(tmp_path):
    other = tmp_path / "ckpt.5000"
    proc = subprocess.Popen([sys.executable, "-c", IN_FLIGHT, str(other)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    in_flight = _temps(tmp_path)
    assert len(in_flight) == 1
    DefaultRecorder().save_item(ITEM, tmp_path / "ckpt")
    assert _temps(tmp_path) == in_flight  # the other saver's file is still there
    out, err = proc.communicate("\n", timeout=60)
    assert proc.returncode == 0 and out.strip() == "saved", err
    assert other.read_bytes() == b"written by the other saver"
    _assert_loads_item(tmp_path / "ckpt")


def test_names_that_merely_look_like_temp_files_are_left_alone(tmp_path):
    lookalikes = [
        ".ckpt.20240101123045.4242.abcd1234.trainrec-tmp",  # made every save raise OverflowError
        f".ckpt.{_dead_pid()}.abc123.trainrec-tmp",  # the old naming: a pid that is gone
        ".ckpt.0123456789AB.trainrec-tmp",  # not lower-case hex
        ".ckpt.0123456789a.trainrec-tmp",  # one digit short
        ".ckpt.x.0123456789ab.trainrec-tmp",  # a temp of the target "ckpt.x"
        "ckpt.0123456789ab.trainrec-tmp",  # no leading dot
    ]
    for name in lookalikes:
        (tmp_path / name).write_bytes(b"not ours")
    DefaultRecorder().save_item(ITEM, tmp_path / "ckpt")
    DefaultRecorder().save_item(ITEM, tmp_path / "ckpt")
    assert _temps(tmp_path) == sorted(lookalikes)
    _assert_loads_item(tmp_path / "ckpt")


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")
def test_temp_files_of_another_user_are_left_alone(tmp_path):
    theirs = [tmp_path / _new_temp_name("ckpt"), tmp_path / f".ckpt.{_dead_pid()}.abc123.trainrec-tmp"]
    for p in theirs:
        p.write_bytes(b"partial")
        os.chown(p, 12345, 12345)
    mine = tmp_path / _new_temp_name("ckpt", "ba9876543210")
    mine.write_bytes(b"partial")  # same pattern, ours, unlocked: an orphan, and removed
    DefaultRecorder().save_item(ITEM, tmp_path / "ckpt")
    assert _temps(tmp_path) == sorted(p.name for p in theirs)


def test_temp_files_a_live_writer_holds_are_left_alone_whatever_their_pid(tmp_path):
    # a writer in another pid namespace (or on another host) has a pid this process cannot
    # see: only its lock tells that it is alive
    held = [tmp_path / _new_temp_name("ckpt"), tmp_path / f".ckpt.{_dead_pid()}.abc123.trainrec-tmp"]
    orphan = tmp_path / _new_temp_name("ckpt", "fedcba987654")
    orphan.write_bytes(b"partial")
    with _held_by_another_process(*held):
        DefaultRecorder().save_item(ITEM, tmp_path / "ckpt")
        assert _temps(tmp_path) == sorted(p.name for p in held)
    DefaultRecorder().save_item(ITEM, tmp_path / "ckpt")  # the writer is gone, and so is its file
    assert _temps(tmp_path) == [held[1].name]
    _assert_loads_item(tmp_path / "ckpt")


def test_a_temp_file_a_cleaner_locked_first_is_not_used(tmp_path):
    """The instant between creating a temp file and locking it: a cleaner that locks it
    there deletes it, so the writer must not use it (it takes another name)."""
    tmp = tmp_path / _new_temp_name("ckpt")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    cleaner = os.open(tmp, os.O_RDONLY)
    try:
        fcntl.flock(cleaner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert _atomic._claim(fd, str(tmp)) is False
        os.unlink(tmp)
        os.close(cleaner)
        assert _atomic._claim(fd, str(tmp)) is False  # locked now, but no longer at its name
    finally:
        os.close(fd)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        assert _atomic._claim(fd, str(tmp)) is True
        _atomic._remove_orphans(tmp_path, "ckpt")  # a cleaner now cannot take it
        assert tmp.exists()
    finally:
        os.close(fd)
    _atomic._remove_orphans(tmp_path, "ckpt")
    assert not tmp.exists()


def test_a_fifo_named_like_a_temp_file_does_not_block_a_save(tmp_path):
    fifo = tmp_path / _new_temp_name("ckpt")
    os.mkfifo(fifo)
    def blocked(*_):
        raise TimeoutError("the save waited on the FIFO")

    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(20)  # a cleaner opening it without O_NONBLOCK would wait forever
    try:
        DefaultRecorder().save_item(ITEM, tmp_path / "ckpt")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


# -- permissions ---------------------------------------------------------------------------


@contextlib.contextmanager
def _umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("mask", [0o077, 0o027, 0o002])
def test_a_new_file_gets_the_current_umask(tmp_path, mask):
    with _umask(mask):
        for recorder, name in ((DefaultRecorder(), "a.mpk"), (NamedMpkGzFileRecorder(), "a.mpk.gz")):
            path = recorder.save_item(ITEM, tmp_path / name)
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~mask, name
            _assert_loads_item(path, recorder)


def test_saving_never_changes_the_process_umask(tmp_path):
    script = textwrap.dedent(
        f"""
        import os
        calls = []
        real = os.umask
        os.umask = lambda m: calls.append(m) or real(m)
        import numpy as np, trainrec
        from trainrec.storage import atomic as _atomic
        trainrec.DefaultRecorder().save_item({{"w": trainrec.TensorData.from_array(np.ones(3))}},
                                             {str(tmp_path / "x.mpk")!r})
        assert calls == [], calls
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_no_thread_ever_sees_the_umask_cleared(tmp_path):
    """Another thread creating files while trainrec is imported and saves run: none of
    its files may come out 0666 (a umask briefly set to 0)."""
    script = textwrap.dedent(
        f"""
        import importlib, os, sys, threading
        sys.setswitchinterval(1e-6)
        os.umask(0o022)
        directory = {str(tmp_path)!r}
        stop, wide = threading.Event(), []

        def create():
            i = 0
            while not stop.is_set():
                p = os.path.join(directory, f"other{{i % 8}}")
                fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                if os.fstat(fd).st_mode & 0o777 != 0o644:
                    wide.append(oct(os.fstat(fd).st_mode))
                os.close(fd)
                os.unlink(p)
                i += 1

        t = threading.Thread(target=create)
        t.start()
        import trainrec.storage.atomic as atomic
        from pathlib import Path
        for i in range(400):
            atomic = importlib.reload(atomic)  # what the import does, many times over
            if i % 40 == 0:
                with atomic.atomic_write(Path(directory) / "ckpt", durable=False) as f:
                    f.write(b"x")
        stop.set()
        t.join()
        assert not wide, f"{{len(wide)}} files created with a cleared umask"
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o604, 0o444])
def test_an_existing_file_keeps_its_mode(tmp_path, mode):
    path = tmp_path / "ckpt.mpk"
    path.write_bytes(b"old")
    os.chmod(path, mode)
    with _umask(0o022):
        with _atomic.atomic_write(path) as f:
            # never readable by more people than the old file, not even while it is written
            assert stat.S_IMODE(os.fstat(f.fileno()).st_mode) == mode
        DefaultRecorder().save_item(ITEM, path)
    assert stat.S_IMODE(os.stat(path).st_mode) == mode
    _assert_loads_item(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="setting another group needs root or a second group")
def test_an_existing_file_keeps_its_group(tmp_path):
    path = tmp_path / "ckpt.mpk"
    DefaultRecorder().save_item(ITEM, path)
    os.chown(path, -1, 4321)
    os.chmod(path, 0o640)
    NamedMpkGzFileRecorder().save_item(ITEM, path)
    st = os.stat(path)
    assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (4321, 0o640)
    _assert_loads_item(path, NamedMpkGzFileRecorder())


# -- paths ---------------------------------------------------------------------------------


def test_a_save_to_a_symlink_writes_through_to_its_target(tmp_path):
    (tmp_path / "store").mkdir()
    real = tmp_path / "store" / "real.mpk"
    DefaultRecorder().save_item({"w": TensorData.from_array(np.zeros(2, np.float32)), "step": 0}, real)
    os.chmod(real, 0o600)
    link = tmp_path / "latest.mpk"
    link.symlink_to(Path("store") / "real.mpk")  # relative, to another directory
    chain = tmp_path / "chain.mpk"
    chain.symlink_to("latest.mpk")
    for path in (link, chain):
        DefaultRecorder().save_item(ITEM, path)
        assert link.is_symlink() and chain.is_symlink() and os.readlink(link) == "store/real.mpk"
        _assert_loads_item(real)
        assert stat.S_IMODE(os.stat(real).st_mode) == 0o600
    assert _temps(tmp_path) == [] and _temps(tmp_path / "store") == []


def test_a_save_to_a_dangling_symlink_creates_its_target(tmp_path):
    link = tmp_path / "next.mpk"
    link.symlink_to("made.mpk")
    DefaultRecorder().save_item(ITEM, link)
    assert link.is_symlink()
    _assert_loads_item(tmp_path / "made.mpk")
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    with pytest.raises(RecorderError, match="loop"):
        DefaultRecorder().save_item(ITEM, loop)
    assert loop.is_symlink()


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_target_that_is_not_a_regular_file_is_refused(tmp_path, kind):
    path = tmp_path / "ckpt"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    with pytest.raises(RecorderError, match="not a regular file"):
        DefaultRecorder().save_item(ITEM, path)
    assert (stat.S_ISFIFO if kind == "fifo" else stat.S_ISDIR)(os.lstat(path).st_mode)
    assert _temps(tmp_path) == []


@pytest.mark.parametrize("length", [230, 240, 250, 255])
def test_names_up_to_name_max_save(tmp_path, length):
    name = ("c" * (length - 4)) + ".mpk"
    for recorder in (DefaultRecorder(), NamedMpkGzFileRecorder()):
        path = recorder.save_item(ITEM, tmp_path / name)
        _assert_loads_item(path, recorder)
    # a long name's temp files are still told apart: another name with the same start is not ours
    twin = "c" * 240 + "-twin.mpk"
    theirs = tmp_path / _new_temp_name(twin)
    theirs.write_bytes(b"partial")
    orphan = tmp_path / _new_temp_name(name)
    orphan.write_bytes(b"partial")
    assert len(orphan.name) <= 255 and orphan.name != theirs.name
    DefaultRecorder().save_item(ITEM, tmp_path / name)
    assert _temps(tmp_path) == [theirs.name]


def test_names_with_multibyte_characters_up_to_name_max_save(tmp_path):
    name = "é" * 125 + ".mpk"  # 254 bytes
    path = DefaultRecorder().save_item(ITEM, tmp_path / name)
    _assert_loads_item(path)
    assert all(len(os.fsencode(n)) <= 255 for n in os.listdir(tmp_path))


FILL_DISK = textwrap.dedent(
    """
    import resource, signal, sys
    import numpy as np
    from trainrec import NamedMpkGzFileRecorder, RecorderError, TensorData
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # the disk is full at 1 MiB
    noise = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8)
    try:
        NamedMpkGzFileRecorder().save_item({"w": TensorData.from_array(noise)}, sys.argv[1])
    except RecorderError as e:
        print("refused:", e)
    """
)


def test_a_gz_save_that_runs_out_of_room_keeps_the_old_file(tmp_path):
    """The Gz recorder cannot reserve its size up front (the compressed size is known only
    once written): a disk that fills fails during the writes, with the old file intact."""
    path = tmp_path / "ckpt.mpk.gz"
    NamedMpkGzFileRecorder().save_item(ITEM, path)
    before = path.read_bytes()
    out = subprocess.run([sys.executable, "-c", FILL_DISK, str(path)], capture_output=True, text=True)
    assert out.returncode == 0 and "refused: cannot write checkpoint" in out.stdout, out.stderr
    assert str(path) in out.stdout
    assert path.read_bytes() == before and _temps(tmp_path) == []


def _read_only_directory_message(tmp_path) -> str:
    path = tmp_path / "ro" / "ckpt.mpk"
    with pytest.raises(RecorderError) as info:
        DefaultRecorder().save_item(ITEM, path)
    _assert_loads_item(path)  # unchanged
    return str(info.value)


def _make_read_only_dir_with_writable_file(tmp_path) -> Path:
    (tmp_path / "ro").mkdir()
    path = tmp_path / "ro" / "ckpt.mpk"
    DefaultRecorder().save_item(ITEM, path)
    os.chmod(path, 0o666)
    os.chmod(tmp_path / "ro", 0o555)
    return path


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_with_a_writable_file_is_refused_clearly(tmp_path):
    _make_read_only_dir_with_writable_file(tmp_path)
    try:
        message = _read_only_directory_message(tmp_path)
    finally:
        os.chmod(tmp_path / "ro", 0o755)
    assert "write permission on the directory" in message and "ckpt.mpk" in message


def test_a_read_only_directory_error_says_why(tmp_path, monkeypatch):
    """As the test above, for root (which the kernel lets write anywhere): the temp file's
    creation fails as it does for everyone else."""
    _make_read_only_dir_with_writable_file(tmp_path)
    real_open = os.open

    def read_only_dir(p, flags, *a, **kw):
        if str(p).endswith(_atomic.TEMP_SUFFIX) and flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", str(p))
        return real_open(p, flags, *a, **kw)

    monkeypatch.setattr(_atomic.os, "open", read_only_dir)
    try:
        message = _read_only_directory_message(tmp_path)
    finally:
        monkeypatch.undo()
        os.chmod(tmp_path / "ro", 0o755)
    assert "write permission on the directory" in message and "ckpt.mpk" in message


def test_a_temp_file_is_locked_for_the_whole_write_and_removed_on_failure(tmp_path):
    path = tmp_path / "ckpt"
    NamedMpkFileRecorder().save_item(ITEM, path)
    with pytest.raises(RuntimeError), _atomic.atomic_write(path) as f:
        tmp = [p for p in tmp_path.iterdir() if p.name.endswith(_atomic.TEMP_SUFFIX)][0]
        other = os.open(tmp, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):  # held for the whole write
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)
        f.write(b"partial")
        raise RuntimeError("stop")
    assert _temps(tmp_path) == []
    _assert_loads_item(path, NamedMpkFileRecorder())


def test_threads_saving_to_neighbouring_names_never_disturb_each_other(tmp_path):
    errors: list[BaseException] = []

    def save(name: str) -> None:
        try:
            for _ in range(40):
                NamedMpkFileRecorder(durable=False).save_item(ITEM, tmp_path / name)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=save, args=(n,)) for n in ("ckpt", "ckpt.5000", "ckpt.5000.1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for n in ("ckpt", "ckpt.5000", "ckpt.5000.1"):
        _assert_loads_item(tmp_path / n)
    assert _temps(tmp_path) == []
