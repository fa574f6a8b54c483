"""The contract every `Store` keeps, run on each: local disk, gs://, s3://
(emulated) and a third object store that exists only in tests
(`folder_store.FolderStore`, ``az://``), which shows that a new kind of
storage is one module and one `stores.register`.

The callers (the commit protocol, `storage.reading.opening`, leftovers, verify) rely
on exactly these promises, and on nothing else of a store.
"""

from __future__ import annotations

import concurrent.futures
import os

import pytest
from etils import epath

from pz_persist import errors
from pz_persist.storage import stores
from pz_persist.storage.stores import base
from pz_persist.storage.stores import objects
from pz_persist.storage.stores import urls


def _store(root: str) -> base.Store:
  return stores.for_path(root)


def test_the_store_is_chosen_by_scheme_alone(root):
  store = _store(root)
  assert store.scheme == urls.scheme(root)
  assert stores.for_path(epath.Path(root)) is store  # An epath.Path alike.
  assert stores.normalise(root) == epath.Path(root)  # Already in its one spelling.


def test_a_written_file_reads_back_whole(root):
  store = _store(root)
  path = epath.Path(root) / "sub" / "f.json"
  store.write_whole(path, b"first")
  assert store.read(path, 100) == b"first"
  store.write_whole(path, b"second, longer")
  assert store.read(path, 100) == b"second, longer"
  with pytest.raises(FileNotFoundError):
    store.read(epath.Path(root) / "absent", 100)


def test_a_large_file_is_read_in_pieces(root):
  store = _store(root)
  path = epath.Path(root) / "large"
  data = os.urandom(3 * 2**20 + 5)
  store.write_whole(path, data)
  with store.open(path) as f:
    pieces = iter(lambda: f.read(2**20), b"")
    assert b"".join(pieces) == data
  with pytest.raises(FileNotFoundError):
    store.open(epath.Path(root) / "absent").close()


def test_read_never_returns_more_than_limit_plus_one(root):
  store = _store(root)
  path = epath.Path(root) / "big"
  store.write_whole(path, b"x" * 50)
  try:
    data = store.read(path, 10)
  except errors.ManifestError:
    return  # Refused by size: as good as cut.
  assert len(data) == 11


def test_create_if_absent_creates_once(root):
  store = _store(root)
  path = epath.Path(root) / "commit"
  assert store.create_if_absent(path, b"one")
  assert not store.create_if_absent(path, b"two")
  assert store.read(path, 100) == b"one"


def test_of_racing_creates_exactly_one_wins(root):
  store = _store(root)
  path = epath.Path(root) / "raced"
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    won = list(pool.map(lambda i: store.create_if_absent(path, b"%d" % i), range(8)))
  assert won.count(True) == 1
  assert store.read(path, 100) == b"%d" % won.index(True)


def test_info_tells_size_and_each_rewrite(root):
  store = _store(root)
  path = epath.Path(root) / "d" / "f"
  assert store.info(path) is None
  store.write_whole(path, b"12345")
  first = store.info(path)
  assert first is not None and first.size == 5
  store.write_whole(path, b"1234567")
  second = store.info(path)
  assert second is not None and second.size == 7
  assert second.generation != first.generation
  assert store.info(epath.Path(root) / "d") is None  # A folder is no file.
  assert store.has_entry(path) and not store.has_entry(epath.Path(root) / "nothing")


def test_names_and_tree_list_what_is_there(root):
  store = _store(root)
  top = epath.Path(root) / "run"
  assert store.names(top) == [] and store.tree(top) == {}
  for name, data in [("a.json", b"1"), ("ab/x", b"22"), ("b/c/d", b"333")]:
    store.write_whole(top / name, data)
  assert store.names(top) == ["a.json", "ab", "b"]
  assert store.names(top, "a") == ["a.json", "ab"]
  tree = store.tree(top)
  assert {name: info.size for name, info in tree.items()} == {
      "a.json": 1, "ab/x": 2, "b/c/d": 3,
  }


def test_remove_deletes_a_file_or_a_tree_and_missing_is_fine(root):
  store = _store(root)
  top = epath.Path(root) / "t"
  store.write_whole(top / "keep", b"k")
  store.write_whole(top / "gone" / "a", b"a")
  store.write_whole(top / "gone" / "b" / "c", b"c")
  store.remove(top / "gone")
  store.remove(top / "keep")
  store.remove(top / "never there")
  assert store.tree(top) == {}


def test_locks_can_be_taken_shared_and_exclusive(root):
  store = _store(root)
  path = epath.Path(root) / "ck"
  store.write_whole(path / "f", b"")
  with store.lock(path, shared=True), store.lock(path, shared=True):
    pass  # Readers never wait for each other.
  with store.lock(path):
    pass
  with store.reading(path):
    pass


def _save(store: base.Store, path: epath.Path, seen: base.Identity, data: bytes) -> bool:
  new = store.new_location(path, os.urandom(8).hex())
  store.write_whole(new / "item" / "payload", data)
  store.check_publishable(path, seen)
  return store.publish(path, new, seen)


def test_a_save_is_published_whole_and_found_by_readers(root):
  store = _store(root)
  path = epath.Path(root) / "ck"
  assert store.identity(path) is None
  assert _save(store, path, None, b"v1")
  seen = store.identity(path)
  assert seen is not None
  folder = store.resolve(path)
  assert store.read(folder / "item" / "payload", 100) == b"v1"


def test_of_two_saves_from_one_view_one_wins_and_the_loser_leaves_nothing(root):
  store = _store(root)
  path = epath.Path(root) / "ck"
  assert _save(store, path, None, b"v1")
  seen = store.identity(path)
  assert _save(store, path, seen, b"v2")
  after = store.identity(path)
  assert after != seen
  assert not _save(store, path, seen, b"stale")  # Lost: path is no longer ``seen``.
  assert store.identity(path) == after
  assert store.read(store.resolve(path) / "item" / "payload", 100) == b"v2"
  listing = store.tree(path.parent)
  assert not [name for name, _ in listing.items() if "stale" in name]
  payloads = [store.read(path.parent / name, 100) for name in listing if name.endswith("payload")]
  assert payloads == [b"v2"]  # Replaced and losing saves' files are gone.


def test_a_path_chosen_once_is_published_by_the_store_it_chose(root):
  store, path = stores.choose(f"{root}/ck")
  assert store is _store(root) and store.identity(path) is None
  new = store.new_location(path, os.urandom(8).hex())
  store.write_whole(new / "f", b"x")
  assert store.publish(path, new, None)
  assert store.identity(path) is not None and store.identity(path) == _store(root).identity(path)


def test_object_stores_pin_a_commit_that_a_replacing_save_retires(root):
  store = _store(root)
  path = epath.Path(root) / "ck"
  assert _save(store, path, None, b"v1")
  pinned = store.pin(path)
  if not isinstance(store, objects.ObjectStore):
    assert pinned is None  # Locks keep its readers safe instead.
    return
  assert pinned is not None and pinned.still_current()
  assert _save(store, path, store.identity(path), b"v2")
  assert not pinned.still_current()
  assert store.orphans(path) == []


def test_an_unregistered_scheme_is_refused_by_name():
  with pytest.raises(errors.UnsupportedStorageError, match=r"hdfs:// is not supported"):
    stores.for_path("hdfs://namenode/ck")


def test_a_registered_store_is_one_register_call_away(az_root):
  assert isinstance(stores.for_path(f"{az_root}/x"), objects.ObjectStore)
  with pytest.raises(errors.UnsupportedStorageError, match=r"az://, gs:// and s3://"):
    stores.for_path("hdfs://namenode/ck")
