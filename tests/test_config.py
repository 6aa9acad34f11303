import dask.config
import pytest
import yaml

import dask_surge
from dask_surge import config
from dask_surge.errors import SurgeValueError


def test_yaml_and_option_table_agree():
    with open(config.DEFAULTS_PATH) as f:
        shipped = yaml.safe_load(f)["surge"]
    assert set(shipped) == set(config.OPTIONS)
    for name, value in shipped.items():
        # every shipped default is valid (sizes such as "512 MiB" resolve to bytes)
        expected = dask.utils.parse_bytes(value) if name == "max-bytes" else value
        assert config.get(name, value) == expected


def test_env_and_set_override(monkeypatch):
    with dask.config.set({"surge.b-min": 123}):
        from dask_surge.planning.thresholds import resolve_thresholds

        assert resolve_thresholds(gpu=False).b_min == 123
    monkeypatch.setenv("DASK_SURGE__PRECISION", "float16")
    dask.config.refresh()
    try:
        assert config.get("precision") == "float16"
    finally:
        monkeypatch.delenv("DASK_SURGE__PRECISION")
        dask.config.refresh()


def test_bad_config_value_is_named():
    with dask.config.set({"surge.on-null": "drop"}):
        with pytest.raises(SurgeValueError, match=r"surge.on-null='drop' is not allowed"):
            config.get("on-null")


def test_max_bytes_takes_sizes_ints_or_null():
    assert config.get("max-bytes", "2 GiB") == 2 * 1024**3
    assert config.get("max-bytes", 1000) == 1000
    with dask.config.set({"surge.max-bytes": None}):
        assert config.get("max-bytes") is None
    for bad in ("lots", 0, -5, True):
        with dask.config.set({"surge.max-bytes": bad}):
            with pytest.raises(SurgeValueError, match=r"surge.max-bytes=.* is not allowed.*Fix"):
                config.get("max-bytes")


def test_accessor_registered():
    import dask.dataframe as dd
    import pandas as pd

    ddf = dd.from_pandas(pd.DataFrame({"text": ["a"]}), npartitions=1)
    assert hasattr(ddf, "surge") and dask_surge.__version__


def test_schema_matches_yaml_and_validates_defaults():
    import os

    jsonschema = pytest.importorskip("jsonschema", reason="schema check needs jsonschema")
    with open(os.path.join(os.path.dirname(config.DEFAULTS_PATH), "surge-schema.yaml")) as f:
        schema = yaml.safe_load(f)
    with open(config.DEFAULTS_PATH) as f:
        defaults = yaml.safe_load(f)
    assert set(schema["properties"]["surge"]["properties"]) == set(defaults["surge"]) == set(config.OPTIONS)
    jsonschema.validate(defaults, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"surge": {**defaults["surge"], "b-min": 0}}, schema)
