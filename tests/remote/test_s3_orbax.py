"""``s3://`` through Orbax's own array handler (`pz_persist.storage.stores.s3_kvstore`).

Plain Orbax 0.12.8 refuses every ``s3://`` array checkpoint and cannot
publish one (its folder rename fails on S3); `pzp.enable_orbax_s3` is what
makes both work, and it must change nothing for any other path. Against
moto's S3 server (the ``s3`` fixture), except the spec checks, which need no
server.
"""

from __future__ import annotations

import textwrap
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import run_python
from etils import epath
from orbax.checkpoint._src.path import atomicity
from orbax.checkpoint._src.path import atomicity_defaults
from orbax.checkpoint._src.serialization import ocdbt_process_spec
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
from penzai import pz
from treecompare import assert_identical

import pz_persist as pzp
from pz_persist.storage import stores
from pz_persist.storage.stores import s3_kvstore

pytestmark = pytest.mark.timeout(300)

_WRITE = ts_utils.OcdbtKvStoreWriteOptions(mode=ts_utils.OcdbtWriteMode.WRITE)


@pytest.fixture
def registered():
  """`enable_orbax_s3` for the test; the state before is restored after."""
  was = s3_kvstore.is_enabled()
  pzp.enable_orbax_s3()
  yield
  if not was:
    pzp.disable_orbax_s3()


@pytest.fixture
def unregistered():
  """Plain Orbax for the test; the state before is restored after."""
  was = s3_kvstore.is_enabled()
  pzp.disable_orbax_s3()
  yield
  if was:
    pzp.enable_orbax_s3()


def _url(s3) -> str:
  return f"{s3.root()}/{uuid.uuid4().hex[:12]}"


def _spec_cases(tmp: str) -> list[tuple[tuple, dict]]:
  """(args, kwargs) of `build_kvstore_tspec` as Orbax's callers pass them."""
  metadata = ts_utils.OcdbtTemporaryMetadataContext(epath.Path(tmp) / "meta")
  process = ocdbt_process_spec.OcdbtProcessSpec("0")
  cases = []
  for directory in (f"{tmp}/ck", f"{tmp}/ck/", "gs://bucket/run/ck", "gs://bucket/run//ck/"):
    cases += [
        ((directory,), {}),
        ((directory, "params.w"), {"use_ocdbt": True, "ocdbt_write_options": _WRITE}),
        ((directory, "params.w"), {"use_ocdbt": False}),
        ((directory,), {"ocdbt_process_spec": process, "ocdbt_write_options": _WRITE,
                        "ocdbt_temporary_metadata_context": metadata}),
        ((directory,), {"ocdbt_write_options": ts_utils.OcdbtKvStoreWriteOptions(
            mode=ts_utils.OcdbtWriteMode.MERGE, store_ocdbt_metadata_and_values_separately=True)}),
    ]
  return cases


def _answers(tmp: str) -> list:
  specs = [ts_utils.build_kvstore_tspec(*a, **k) for a, k in _spec_cases(tmp)]
  classes = [
      f(epath.Path(p))
      for p in (tmp, "gs://bucket/run")
      for f in (atomicity_defaults.get_default_temporary_path_class,
                atomicity_defaults.get_item_default_temporary_path_class)
  ]
  return specs + classes


def test_nothing_changes_for_local_and_gcs_paths(tmp_path, unregistered):
  plain = _answers(str(tmp_path))
  pzp.enable_orbax_s3()
  try:
    assert s3_kvstore.is_enabled()
    assert _answers(str(tmp_path)) == plain
  finally:
    pzp.disable_orbax_s3()
  assert _answers(str(tmp_path)) == plain


def test_enabling_twice_wraps_once_and_disabling_restores_orbax(unregistered):
  original = ts_utils.build_kvstore_tspec
  pzp.enable_orbax_s3()
  wrapped = ts_utils.build_kvstore_tspec
  pzp.enable_orbax_s3()
  assert ts_utils.build_kvstore_tspec is wrapped is not original
  pzp.disable_orbax_s3()
  assert ts_utils.build_kvstore_tspec is original
  with pytest.raises(ValueError, match="absolute"):
    ts_utils.build_kvstore_tspec("s3://bucket/ck", "w")


def test_enable_for_registers_on_s3_paths_only(unregistered):
  s3_kvstore.enable_for("/tmp/ck")
  s3_kvstore.enable_for("gs://bucket/ck")
  assert not s3_kvstore.is_enabled()
  s3_kvstore.enable_for(epath.Path("s3://bucket/ck"))
  assert s3_kvstore.is_enabled()


def test_s3_specs_keep_everything_orbax_adds(registered, tmp_path, monkeypatch):
  monkeypatch.setenv("AWS_ENDPOINT_URL", "http://store.example:9000")
  monkeypatch.setenv("AWS_REGION", "eu-west-3")
  s3 = {"driver": "s3", "bucket": "My_Bucket", "endpoint": "http://store.example:9000",
        "aws_region": "eu-west-3"}
  for (args, kwargs), (gs_args, _) in zip(
      _spec_cases(str(tmp_path)), _spec_cases(str(tmp_path)), strict=True):
    if not args[0].startswith("gs://"):
      continue
    gs_spec = ts_utils.build_kvstore_tspec(*gs_args, **kwargs)
    s3_spec = ts_utils.build_kvstore_tspec(args[0].replace("gs://bucket", "s3://My_Bucket"),
                                           *args[1:], **kwargs)
    # The same spec but for the base: every option Orbax adds for a remote store.
    assert _bases_removed(s3_spec) == _bases_removed(gs_spec)
    assert _bases(s3_spec), s3_spec
    for base, gs_base in zip(_bases(s3_spec), _bases(gs_spec), strict=True):
      assert base == {**s3, "path": gs_base["path"]}
  ocdbt = ts_utils.build_kvstore_tspec("s3://b/run/ck", "w", ocdbt_write_options=_WRITE)
  assert ocdbt["target_data_file_size"] == ts_utils._GCS_OCDBT_TARGET_DATA_FILE_SIZE  # pylint: disable=protected-access
  assert ocdbt["base"]["path"] == "run/ck"
  assert ts_utils.build_kvstore_tspec("s3://b/run/ck", "w", use_ocdbt=False)["path"] == "run/ck/w"


def test_string_bases_are_swapped_too(monkeypatch):
  """Orbax may name a GCS base as a URL string (its own code allows for it)."""
  monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
  monkeypatch.setenv("AWS_ENDPOINT_URL", "http://e:1")
  placeholder = s3_kvstore._PLACEHOLDER_URL  # pylint: disable=protected-access
  spec = {"driver": "ocdbt", "base": f"{placeholder}/run/ck/",
          "manifest": {"driver": "kvstack", "layers": [{"base": placeholder}]},
          "path": "gs://other-bucket/x"}
  swapped = s3_kvstore._swap_gcs_for_s3(spec, "b")  # pylint: disable=protected-access
  assert swapped["base"]["path"] == "run/ck/" and swapped["base"]["bucket"] == "b"
  assert swapped["base"]["endpoint"] == "http://e:1"
  assert swapped["manifest"]["layers"][0]["base"]["path"] == ""
  assert swapped["path"] == "gs://other-bucket/x"  # Not the placeholder: kept.


def _bases(spec):
  if isinstance(spec, dict):
    if spec.get("driver") in ("s3", "gcs"):
      return [spec]
    return [b for v in spec.values() for b in _bases(v)]
  if isinstance(spec, list):
    return [b for v in spec for b in _bases(v)]
  return []


def _bases_removed(spec):
  if isinstance(spec, dict):
    if spec.get("driver") in ("s3", "gcs"):
      return "BASE"
    return {k: _bases_removed(v) for k, v in spec.items()}
  if isinstance(spec, list):
    return [_bases_removed(v) for v in spec]
  return spec


@pytest.mark.parametrize(
    ("env", "endpoint", "region"),
    [
        ({}, None, None),
        ({"AWS_ENDPOINT_URL": "http://a:1", "AWS_DEFAULT_REGION": "r1"}, "http://a:1", "r1"),
        ({"AWS_ENDPOINT_URL": "http://a:1", "AWS_ENDPOINT_URL_S3": "http://s3:2",
          "AWS_DEFAULT_REGION": "r1", "AWS_REGION": "r2"}, "http://s3:2", "r2"),
    ],
)
def test_endpoint_and_region_come_from_the_environment(registered, monkeypatch, env, endpoint, region):
  for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION"):
    monkeypatch.delenv(name, raising=False)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  spec = ts_utils.build_kvstore_tspec("s3://b/ck", "w", use_ocdbt=False)
  assert spec.get("endpoint") == endpoint
  assert spec.get("aws_region") == region


def test_plain_orbax_refuses_s3_without_the_registration(s3, unregistered, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # Where Orbax's relative "s3:/..." files land.
  with ocp.StandardCheckpointer() as checkpointer:
    with pytest.raises(ValueError, match="absolute"):
      checkpointer.save(f"{_url(s3)}/ck", {"w": np.arange(3.0)})
      checkpointer.wait_until_finished()


def test_plain_orbax_round_trip_on_s3(s3, registered):
  url = f"{_url(s3)}/ck"
  tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([7, 8], np.int32)}
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(url, tree)
    restored = checkpointer.restore(url)
  assert_identical(restored, tree)
  # Published in place by the commit file, as on GCS: no temporary folder.
  parent = url.rsplit("/", 1)[0]
  assert stores.for_path(parent).names(parent) == ["ck"]
  assert atomicity.COMMIT_SUCCESS_FILE in stores.for_path(url).names(url)


def test_plain_orbax_checkpoint_manager_on_s3(s3, registered):
  run = _url(s3)
  options = ocp.CheckpointManagerOptions(max_to_keep=2)
  with ocp.CheckpointManager(run, options=options) as manager:
    for step in range(3):
      manager.save(step, args=ocp.args.StandardSave({"w": np.arange(3.0) + step}))
    manager.wait_until_finished()
    assert manager.all_steps() == [1, 2]
  # A step without its commit file is unfinished, as on GCS.
  stores.for_path(run).write_whole(f"{run}/7/default/_METADATA", b"{}")
  with ocp.CheckpointManager(run, options=options) as manager:
    assert manager.all_steps() == [1, 2]
    restored = manager.restore(2, args=ocp.args.StandardRestore())
  np.testing.assert_array_equal(restored["w"], np.arange(3.0) + 2)


def test_sharded_array_on_s3(s3, registered, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  devices = np.array(jax.devices()[:8]).reshape(2, 4)
  mesh = jax.sharding.Mesh(devices, ("a", "b"))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b"))
  value = jax.device_put(jnp.arange(32.0).reshape(4, 8), sharding)
  url = f"{_url(s3)}/ck"
  other = jax.sharding.NamedSharding(
      jax.sharding.Mesh(devices.reshape(4, 2), ("a", "b")), jax.sharding.PartitionSpec(None, "b"))
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(url, {"w": value})
    for target in (sharding, other):
      restored = checkpointer.restore(
          url, {"w": jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=target)})
      assert restored["w"].sharding == target
      np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(32.0).reshape(4, 8))
  # Unregistered, Orbax wrote the "_sharding" record into ./s3:/<bucket>/...
  assert not list(tmp_path.iterdir())


def test_orbax_v1_on_s3(s3, registered):
  from orbax.checkpoint import v1 as ocp_v1  # pylint: disable=import-outside-toplevel

  url = f"{_url(s3)}/ck"
  tree = {"w": jnp.arange(4.0), "n": np.ones(2, np.int8)}
  ocp_v1.save_pytree(url, tree)
  restored = ocp_v1.load_pytree(url)
  np.testing.assert_array_equal(restored["w"], tree["w"])
  np.testing.assert_array_equal(restored["n"], tree["n"])


def test_the_docstring_example_runs(s3, registered):
  example = pzp.enable_orbax_s3.__doc__.split("Example::", 1)[1]
  code = textwrap.dedent(example).replace("s3://my-bucket", _url(s3))
  scope: dict = {}
  exec(compile(code, "enable_orbax_s3 example", "exec"), scope)  # pylint: disable=exec-used
  np.testing.assert_array_equal(scope["restored"]["w"], np.ones(3))


def test_pzp_save_and_load_on_s3(s3, registered):
  url = f"{_url(s3)}/ck"
  tree = {"w": pz.nx.wrap(jnp.arange(6.0).reshape(2, 3)).tag("a", "b"), "n": 3}
  pzp.save(url, tree)
  assert_identical(pzp.load(url), tree)
  assert pzp.inspect(url)["w"].named_shape == {"a": 2, "b": 3}


def test_a_missing_extra_is_named():
  """Without gcsfs / s3fs, every entry point says which extra to install."""
  out = run_python(
      """
      import sys
      sys.modules["gcsfs"] = None  # As if not installed: import raises.
      sys.modules["s3fs"] = None
      import numpy as np
      import pz_persist as pzp
      for scheme, extra in (("gs", "gcs"), ("s3", "s3")):
        url = f"{scheme}://bucket/run/ck"
        for name, call in (
            ("save", lambda: pzp.save(url, {"w": np.arange(3.0)})),
            ("load", lambda: pzp.load(url)),
            ("inspect", lambda: pzp.inspect(url)),
            ("manager", lambda: pzp.CheckpointManager(url)),
        ):
          try:
            call()
          except pzp.errors.MissingExtraError as e:
            assert f"pip install 'pz-persist[{extra}]'" in str(e), (name, e)
            assert url in str(e), (name, e)
            print("named", scheme, name)
      """,
      timeout=120,
  )
  assert out.split("\n").count("named gs save") == 1
  assert len([line for line in out.splitlines() if line.startswith("named")]) == 8, out


def test_importing_and_local_or_gcs_use_register_nothing(gcs, tmp_path):
  out = run_python(
      f"""
      import numpy as np
      import pz_persist as pzp
      from pz_persist.storage.stores import s3_kvstore
      assert not s3_kvstore.is_enabled()
      pzp.save({str(tmp_path / "ck")!r}, {{"w": np.arange(3.0)}})
      pzp.load({str(tmp_path / "ck")!r})
      try:
        pzp.inspect("gs://pz-test/absent")
      except Exception:
        pass
      print("enabled", s3_kvstore.is_enabled())
      """,
      timeout=120,
      env=gcs.env,
  )
  assert "enabled False" in out


def test_pz_persist_registers_on_its_first_s3_path(s3):
  url = f"{_url(s3)}/ck"
  out = run_python(
      f"""
      import numpy as np
      import pz_persist as pzp
      from pz_persist.storage.stores import s3_kvstore
      pzp.save({url!r}, {{"w": np.arange(3.0)}})
      print("enabled", s3_kvstore.is_enabled())
      print(pzp.load({url!r})["w"].tolist())
      """,
      timeout=120,
      env=s3.env,
  )
  assert "enabled True" in out and "[0.0, 1.0, 2.0]" in out
