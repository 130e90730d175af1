"""The :class:`~lightning_bpk.store.Store` seam: one contract, checked on both backends (a local
directory and ``memory://``), so every caller above it can be written once; then what the seam
does with URLs, how it reads an object in ranges, and how an object store's calls are retried
(on ``faulty://``, a filesystem that fails at the k-th call of each kind: ``tests/_backends.py``).

The same store against a real S3 server (moto over HTTP through s3fs) is in
``tests/test_object_storage.py``; the lease (``store/lease.py``) in ``tests/test_store_lease.py``.
"""

from __future__ import annotations

import errno
import os
import threading
import uuid
from pathlib import Path

import _backends as b
import fsspec
import pytest
import torch
from _backends import FaultyFileSystem, faulty  # noqa: F401 - a fixture, used by name
from fsspec.implementations.memory import MemoryFileSystem

from lightning_bpk.checkpointer import Checkpointer, get_latest_checkpoint_number
from lightning_bpk.errors import CheckpointLockedError, StorageError
from lightning_bpk.store import (
    LocalStore,
    MissingDriverError,
    ObjectStore,
    Store,
    join,
    location,
    object_store,
    open_parent,
    open_store,
    parent_of,
)
from lightning_bpk.store import objects as store_objects
from lightning_bpk.store.local import LOCK_FILE_NAME


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path) -> Store:
    if request.param == "local":
        return open_store(tmp_path / "run")
    return open_store(f"memory://bucket-{uuid.uuid4().hex[:8]}/run")


def test_open_store_picks_the_backend(tmp_path):
    assert isinstance(open_store(tmp_path), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    assert isinstance(open_store("memory://b/run"), ObjectStore)
    store, key = open_parent("memory://b/run/model.bpk")
    assert (store.url, key) == ("memory://b/run", "model.bpk")
    for backend in (open_store(tmp_path), open_store("memory://b/run")):
        assert isinstance(backend, Store)


def test_put_read_size_list(store):
    store.check(create=True)
    assert store.size("a") is None
    assert store.put("a", b"hello") is True
    assert store.put("d/b", b"xyz") is True
    assert store.size("a") == 5
    assert store.read("a") == b"hello"
    assert store.read("a", 1, 3) == b"el"
    assert store.list("") == {"a": 5, "d": None}
    assert store.list("d") == {"b": 3}
    assert store.list("nothing") == {}
    buffer = bytearray(3)
    store.read_into("a", buffer, offset=2)
    assert buffer == b"llo"
    assert store.url_of("d/b").endswith("/run/d/b")
    with pytest.raises(FileNotFoundError):
        store.read("missing")


def test_a_listing_leaves_out_entries_removed_while_it_runs(store):
    """A retention in another process removes files while this one lists the directory (a
    resume choosing its checkpoint, an evaluation process reading a live run): each listing
    holds only names with their sizes, never an error for a name that vanished under it."""
    store.check(create=True)
    names = [f"sentinel_{i}" for i in range(64)]
    stop = threading.Event()
    churned = [0]

    def churn() -> None:
        while not stop.is_set():
            for name in names:
                store.put(name, b"x" * 7)
            for name in names:
                store.remove(name)
            churned[0] += 1

    writer = threading.Thread(target=churn, daemon=True)
    writer.start()
    try:
        listings = 0
        while listings < 400 or churned[0] < 3:
            listing = store.list("")
            for name, size in listing.items():
                if name in names:
                    assert size == 7, (name, size)  # a name appears whole (by rename or PUT)
                else:  # the local put's scratch file, beside the name it becomes
                    assert name.partition(".")[0] in names and isinstance(size, int), name
            listings += 1
    finally:
        stop.set()
        writer.join(timeout=60)
    assert not writer.is_alive()


def test_create_only_refuses_other_bytes_and_accepts_its_own(store):
    store.check(create=True)
    assert store.put("s", b"first", create_only=True) is True
    assert store.put("s", b"first", create_only=True) is True  # our own create, retried
    assert store.put("s", b"other", create_only=True) is False
    assert store.read("s") == b"first"
    assert store.create("t", b"x") is True
    assert store.create("t", b"y") is False
    store.put("s", b"replaced")  # not create-only: replaces whole
    assert store.read("s") == b"replaced"


def test_scratch_publishes_on_success_and_leaves_nothing_on_failure(store):
    store.check(create=True)
    with store.scratch("d/file.bin") as path:
        path.write_bytes(b"data")
        assert store.size("d/file.bin") is None  # not visible before the exit
    assert store.read("d/file.bin") == b"data"
    with pytest.raises(RuntimeError), store.scratch("d/file.bin") as path:
        path.write_bytes(b"half")
        raise RuntimeError("failed while writing")
    assert store.read("d/file.bin") == b"data"  # untouched
    assert store.list("d") == {"file.bin": 4}  # no scratch file left
    if isinstance(store, ObjectStore):
        assert not path.parent.exists()  # the local scratch folder is gone too


def test_sink_publishes_on_success_and_leaves_nothing_on_failure(store):
    store.check(create=True)
    data = bytes(range(256)) * 5000  # past DIRECT_MIN: O_DIRECT on a local disk that has it
    with store.sink("d/file.bin", len(data)) as sink:
        sink.write(data[:1000])
        sink.write(data[1000:])
        sink.patch(3, b"xyz")
        assert store.size("d/file.bin") is None  # not visible before the exit
    assert store.read("d/file.bin") == data[:3] + b"xyz" + data[6:]
    if isinstance(store, ObjectStore):
        assert not sink.direct  # the upload reads the scratch file back at once
    with pytest.raises(RuntimeError), store.sink("d/file.bin", 4) as sink:
        sink.write(b"half")
        raise RuntimeError("failed while writing")
    assert store.read("d/file.bin") == data[:3] + b"xyz" + data[6:]  # untouched
    assert store.list("d") == {"file.bin": len(data)}  # no scratch file left


def test_staging_and_publish_make_a_prefix_visible(store, tmp_path):
    store.check(create=True)
    staging = store.staging("ckpt.3")
    with store.scratch(f"{staging}/model.bpk") as path:
        path.write_bytes(b"m" * 10)
    store.publish(staging, "ckpt.3")
    assert store.list("ckpt.3") == {"model.bpk": 10}
    assert {k for k in store.list("") if k.startswith("ckpt.3")} == {"ckpt.3"}
    # a local directory of files, published under a name never used
    folder = tmp_path / "files"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.bpk").write_bytes(b"a")
    (folder / "sub" / "b.bpk").write_bytes(b"bb")
    store.publish(folder, "ckpt.4")
    assert store.list("ckpt.4") == {"a.bpk": 1, "sub": None}
    assert store.read("ckpt.4/sub/b.bpk") == b"bb"
    store.remove_prefix("ckpt.3")
    store.remove(["ckpt.4/a.bpk", "never-there"])
    assert store.list("ckpt.3") == {}
    assert store.list("ckpt.4") == {"sub": None}


def test_local_publish_needs_a_name_never_used(tmp_path):
    store = open_store(tmp_path)
    store.put("ckpt.1/x", b"old")
    staging = store.staging("ckpt.1")
    with pytest.raises(FileExistsError):
        store.publish(staging, "ckpt.1")
    assert store.read("ckpt.1/x") == b"old"


def test_local_files_in_a_staging_folder_are_fsynced_once_by_publish(tmp_path, monkeypatch):
    """Below a staging folder nothing is visible under a final name until publish renames the
    folder, so files there are written in place and fsynced once, by publish (with the folder,
    before the rename); a failed write there leaves no partial file."""
    store = open_store(tmp_path)
    store.check(create=True)
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    staging = store.staging("ckpt.5")
    data = bytes(range(256)) * 2000  # past DIRECT_MIN
    with store.sink(f"{staging}/model.bpk", len(data)) as sink:
        sink.write(data)
    store.put(f"{staging}/sub/trainer.bpk", b"t")
    with store.scratch(f"{staging}/extra.bin") as path:
        path.write_bytes(b"e")
    assert synced == []  # no fsync before publish
    with pytest.raises(RuntimeError), store.sink(f"{staging}/broken.bpk", 4) as sink:
        sink.write(b"ha")
        raise RuntimeError("failed while writing")
    assert sorted(store.list(staging)) == ["extra.bin", "model.bpk", "sub"]
    store.publish(staging, "ckpt.5")
    folder = str(tmp_path / staging)
    files = {f"{folder}/model.bpk", f"{folder}/sub/trainer.bpk", f"{folder}/extra.bin"}
    assert sorted(synced[:-1]) == sorted([*files, folder, f"{folder}/sub"])
    assert synced[-1] == str(tmp_path)  # the rename, after every file and folder
    assert store.read("ckpt.5/model.bpk") == data
    assert store.read("ckpt.5/sub/trainer.bpk") == b"t"
    # outside a staging folder every write is durable on its own, as before
    synced.clear()
    store.put("plain", b"p")
    assert len(synced) == 2 and synced[0].startswith(f"{tmp_path}/plain.")  # its scratch file
    assert synced[1] == str(tmp_path)
    # another store of this process writing into this process's staging folder: still once
    staging = store.staging("ckpt.6")
    synced.clear()
    open_store(tmp_path).put(f"{staging}/rank1.bpk", b"r")
    assert synced == []
    # a staging folder another process made (a rank, maybe on another node of a shared
    # filesystem, where this process's fsync would not reach the writer's cache): every file
    # written into it is durable on its own, as it is written
    foreign = f"ckpt.6.{os.getpid() + 1}-0.tmp"
    (tmp_path / foreign).mkdir()
    store.put(f"{foreign}/rank1.bpk", b"r")
    assert synced and synced[0].startswith(f"{tmp_path}/{foreign}/rank1.bpk.")


def test_the_lock_file_names_its_holder_over_whatever_an_earlier_holder_wrote(tmp_path):
    """The pid is written fixed-width over the old content (no truncate per save)."""
    store = open_store(tmp_path)
    (tmp_path / LOCK_FILE_NAME).write_text("4194304\n")  # a longer pid, as older versions wrote
    with store.exclusive():
        assert (tmp_path / LOCK_FILE_NAME).read_text().strip() == str(os.getpid())


def test_exclusive_is_a_lock_locally_and_nothing_remotely(store, tmp_path):
    store.check(create=True)
    with store.exclusive():
        if isinstance(store, LocalStore):
            locked = pytest.raises(CheckpointLockedError, match=str(os.getpid()))
            with locked, open_store(store.root).exclusive():
                pass
        else:
            with store.exclusive():
                pass


def test_a_child_forked_while_the_lock_is_held_does_not_keep_it(tmp_path):
    """A DataLoader worker forked while an asynchronous save holds the lock inherits the lock
    file; the flock belongs to the open file, so the child must not keep it past the save."""
    store = open_store(tmp_path)
    store.check(create=True)
    started, release = os.pipe(), os.pipe()
    with store.exclusive():
        pid = os.fork()
        if pid == 0:  # the child: alive until the parent has taken the lock again
            os.write(started[1], b"x")
            os.read(release[0], 1)
            os._exit(0)
    try:
        assert os.read(started[0], 1) == b"x"  # the child runs (its fork handlers have)
        with store.exclusive():
            pass
    finally:
        os.write(release[1], b"x")
        os.waitpid(pid, 0)
        for fd in (*started, *release):
            os.close(fd)


def test_local_reads_refuse_symlinks(tmp_path):
    store = open_store(tmp_path)
    store.put("real", b"x")
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(ValueError, match="symlink"):
        store.read("link")
    assert store.refused("") == [
        f"{tmp_path / 'link'} is a symlink: refused, never followed "
        "(a checkpoint is made of real files)"
    ]
    assert open_store("memory://b/x").refused("") == []


def test_local_check_creates_or_names_what_is_not_a_directory(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(OSError):
        open_store(tmp_path / "file").check(create=True)
    open_store(tmp_path / "a" / "b").check(create=True)
    assert (tmp_path / "a" / "b").is_dir()


def test_a_failing_object_store_raises_storage_error_naming_the_url(monkeypatch):
    store = open_store(f"memory://bucket-{uuid.uuid4().hex[:8]}/run")
    monkeypatch.setattr("lightning_bpk.store.objects.BASE_WAIT", 0.0)

    def broken(*args, **kwargs):
        raise ConnectionError("reset")

    monkeypatch.setattr(store.fs, "pipe_file", broken)
    with pytest.raises(StorageError, match=r"memory://bucket-.*/run/k"):
        store.put("k", b"x")


def _fail(monkeypatch: pytest.MonkeyPatch, module: object, name: str, code: int) -> None:
    """Every later call of ``module.name`` raises OSError ``code`` (an injected fault)."""

    def failing(*args: object, **kwargs: object) -> None:
        raise OSError(code, f"{os.strerror(code)} (injected)")

    monkeypatch.setattr(module, name, failing)


def _publish(store: LocalStore) -> None:
    staging = store.staging("ckpt.1")
    store.put(f"{staging}/model.bpk", b"m")
    store.publish(staging, "ckpt.1")


def _sink(store: LocalStore) -> None:
    with store.sink("big.bpk", 4096) as sink:
        sink.write(b"x" * 4096)


def _exclusive(store: LocalStore) -> None:
    with store.exclusive():
        pass


# Each store call, and a stdlib call it makes that fails: (what it does, which call fails).
_LOCAL_FAULTS = {
    "check": (lambda s: s.check(create=True), (os, "mkdir")),
    "list": (lambda s: s.list(""), (os, "scandir")),
    "read": (lambda s: s.read("a"), (os, "preadv")),
    "read_into": (lambda s: s.read_into("a", bytearray(1)), (os, "preadv")),
    "read_ranges": (lambda s: s.read_ranges("a", [(bytearray(1), 0)]), (os, "preadv")),
    "open_file": (lambda s: s.open_file("a"), (os, "open")),
    "put": (lambda s: s.put("b", b"new"), (os, "fsync")),
    "create": (lambda s: s.create("b", b"new"), (os, "link")),
    "sink": (_sink, (os, "fsync")),
    "staging": (lambda s: s.staging("ckpt.2"), (os, "mkdir")),
    "publish": (_publish, (os, "rename")),
    "remove": (lambda s: s.remove(["a"]), (os, "unlink")),
    "remove_prefix": (lambda s: s.remove_prefix("d"), (os, "rmdir")),
    "exclusive": (_exclusive, (os, "pwrite")),
}


@pytest.mark.parametrize("code", [errno.EIO, errno.EROFS, errno.EDQUOT, errno.ENOSPC])
@pytest.mark.parametrize("call", sorted(_LOCAL_FAULTS))
def test_a_failing_local_disk_raises_storage_error_naming_the_directory(
    tmp_path, monkeypatch, call, code
):
    """EIO from a dying disk (an ext4 shutdown), EROFS, EDQUOT and ENOSPC at any call of the
    local backend reach the caller as the package's StorageError naming the call and the
    directory, errno kept and the cause chained: never a raw OSError."""
    store = open_store(tmp_path / "run")
    store.check(create=True)
    store.put("a", b"hello")
    store.put("d/b", b"xyz")
    action, (module, name) = _LOCAL_FAULTS[call]
    if call == "check":
        store = open_store(tmp_path / "new")
    _fail(monkeypatch, module, name, code)
    with pytest.raises(StorageError) as error:
        action(store)
    assert error.value.errno == code
    assert str(store.root) in str(error.value) and "(injected)" in str(error.value)
    assert isinstance(error.value.__cause__, OSError)


# --- URLs -----------------------------------------------------------------------------------------


def test_location_keeps_urls_and_makes_local_paths(tmp_path):
    assert location("s3://b/run/") == "s3://b/run"
    assert location(f"file://{tmp_path}") == tmp_path
    assert location(str(tmp_path)) == tmp_path
    assert join("s3://b/run", "ckpt.1") == "s3://b/run/ckpt.1"
    assert parent_of("s3://b/run/ckpt.1") == "s3://b/run"


def test_missing_driver_names_the_extra(monkeypatch):
    def no_driver(url, **kwargs):
        raise ImportError("Install gcsfs to access Google Storage")

    monkeypatch.setattr(fsspec.core, "url_to_fs", no_driver)
    with pytest.raises(MissingDriverError, match=r"pip install 'lightning-bpk\[gcs\]'"):
        open_store("gs://bucket/run")


def test_unknown_protocol_is_an_error_naming_the_url():
    with pytest.raises(StorageError, match="nosuch://b/run"):
        open_store("nosuch://b/run")


def test_a_memory_url_is_stored_in_memory_and_never_in_a_local_folder(tmp_path, monkeypatch):
    """The old bug: Path("memory://b/run") made a local folder 'memory:' in the working dir."""
    monkeypatch.chdir(tmp_path)
    where = b.make_where("memory", tmp_path)
    url = str(where.base)
    checkpointer = Checkpointer(url)
    assert checkpointer.save_checkpoint(0, b.record_payload(0)) == f"{url}/ckpt.0"
    assert os.listdir(tmp_path) == []
    assert where.names() == [
        "ckpt.0/model.bpk",
        "ckpt.0/trainer.bpk",
        "sentinel_checkpoint_complete.0",
    ]
    assert get_latest_checkpoint_number(url, verify=True) == 0
    loaded = checkpointer.load_checkpoint(0)
    assert loaded["trainer"] == {"step": 0}
    assert torch.equal(
        loaded["model"].tensors["weight"], b.record_payload(0)["model"].tensors["weight"]
    )


def test_a_local_url_with_file_protocol_is_the_local_protocol(tmp_path):
    checkpointer = Checkpointer(f"file://{tmp_path}/run")
    assert checkpointer.base_directory == Path(tmp_path / "run")
    checkpointer.save_checkpoint(0, {"x": 1})
    assert (tmp_path / "run" / "sentinel_checkpoint_complete.0").is_file()


# --- ranged reads from an object store ------------------------------------------------------------


def test_an_object_is_read_in_at_most_read_streams_ranged_requests(tmp_path, monkeypatch):
    monkeypatch.setattr(store_objects, "READ_CHUNK", 1024)
    store = object_store(str(b.make_where("memory", tmp_path).base))
    data = os.urandom(100 * 1024 + 5)
    store.put("blob", data)
    requests = []
    cat_ranges = MemoryFileSystem.cat_ranges

    def counted(self, paths, starts, ends, **kwargs):
        requests.extend(zip(starts, ends, strict=True))
        return cat_ranges(self, paths, starts, ends, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "cat_ranges", counted)
    buffer = bytearray(len(data) - 5)
    store.read_into("blob", buffer, offset=5)
    assert bytes(buffer) == data[5:]
    assert len(requests) == store_objects.READ_STREAMS  # 12.8 KiB each, not 100 of READ_CHUNK


# --- retries, on a filesystem that fails at the k-th call of each kind ----------------------------


@pytest.mark.usefixtures("faulty")
def test_transient_failures_are_retried_and_the_save_succeeds() -> None:
    url = "faulty://b/transient"
    checkpointer = Checkpointer(url)
    for kind in ("put", "pipe", "ls", "info"):  # the first two calls of each kind fail
        FaultyFileSystem.faults[kind] = (1, 2, TimeoutError)
    checkpointer.save_checkpoint(0, b.record_payload(0))
    FaultyFileSystem.faults.clear()
    assert get_latest_checkpoint_number(url, verify=True) == 0


@pytest.mark.usefixtures("faulty")
def test_an_upload_whose_multipart_completion_was_lost_is_retried() -> None:
    """s3fs raises FileNotFoundError (NoSuchUpload) when completing a multipart upload failed
    and aborting it found nothing (seen with a 1 GiB upload to a loaded server); when the object
    does not appear within COMPLETION_WAIT, it is uploaded again."""
    url = "faulty://b/lost-upload"
    checkpointer = Checkpointer(url)
    FaultyFileSystem.faults["put"] = (1, 1, FileNotFoundError)
    checkpointer.save_checkpoint(0, b.record_payload(0))
    assert get_latest_checkpoint_number(url, verify=True) == 0


@pytest.mark.usefixtures("faulty")
def test_retries_are_bounded_and_the_error_names_the_url() -> None:
    checkpointer = Checkpointer("faulty://b/bounded")
    FaultyFileSystem.faults["put"] = (1, 10**6, ConnectionError)
    with pytest.raises(StorageError, match=r"faulty://b/bounded/ckpt\.0/.*5 attempts"):
        checkpointer.save_checkpoint(0, b.record_payload(0))
    assert FaultyFileSystem.calls["put"] == store_objects.ATTEMPTS


@pytest.mark.usefixtures("faulty")
def test_a_permanent_error_is_not_retried() -> None:
    checkpointer = Checkpointer("faulty://b/denied")
    FaultyFileSystem.faults["put"] = (1, 10**6, PermissionError)
    with pytest.raises(PermissionError):
        checkpointer.save_checkpoint(0, b.record_payload(0))
    assert FaultyFileSystem.calls["put"] == 1


def test_read_ranges_fills_each_piece_at_its_offset(store):
    """Many positional reads of one key in one call (a tensor shard's rows); a range past the
    end is an error, not a short buffer."""
    store.check(create=True)
    store.put("f", bytes(range(100)))
    first, second, empty = bytearray(3), memoryview(bytearray(4)), bytearray(0)
    store.read_ranges("f", [(first, 10), (second, 96), (empty, 50)])
    assert bytes(first) == bytes([10, 11, 12]) and bytes(second) == bytes([96, 97, 98, 99])
    with pytest.raises(OSError):
        store.read_ranges("f", [(bytearray(8), 96)])
    with pytest.raises(FileNotFoundError):
        store.read_ranges("missing", [(bytearray(1), 0)])


def test_follow_links_lets_reads_through_a_symlink_only_when_asked(tmp_path):
    """A checkpoint's reads never follow a symlink; a reader of files other tools wrote (a hub
    cache links its files) asks to (object stores have no links: the option changes nothing)."""
    (tmp_path / "blob").write_bytes(b"weights")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "model.bin").symlink_to(tmp_path / "blob")
    with pytest.raises(ValueError, match="symlink"):
        open_store(tmp_path / "run").read("model.bin")
    linked = open_store(tmp_path / "run", follow_links=True)
    assert linked.read("model.bin") == b"weights"
    buffer = bytearray(3)
    linked.read_ranges("model.bin", [(buffer, 4)])
    assert buffer == b"hts"
    remote = open_store(f"memory://bucket-{uuid.uuid4().hex[:8]}/run", follow_links=True)
    remote.put("k", b"v")
    assert remote.read("k") == b"v"


def test_open_file_reads_a_key_as_a_seekable_file(store):
    """For readers that take a file object (torch.load): the same bytes on both backends."""
    store.check(create=True)
    store.put("d/f.bin", bytes(range(50)))
    with store.open_file("d/f.bin") as file:
        assert file.read(3) == bytes([0, 1, 2])
        file.seek(40)
        assert file.read() == bytes(range(40, 50))
    with pytest.raises(FileNotFoundError):
        store.open_file("missing")
