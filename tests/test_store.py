"""The :class:`~lightning_bpk.store.Store` seam: one contract, checked on both backends (a local
directory and ``memory://``), so every caller above it can be written once."""

from __future__ import annotations

import os
import uuid

import pytest

from lightning_bpk.errors import CheckpointLockedError, StorageError
from lightning_bpk.store import LocalStore, ObjectStore, Store, open_parent, open_store
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
