"""One declaration per option (dask_surge.options): the API, the CLI, the config, the docs and the
fingerprint derive from it, and a test fails when any of them drifts."""

from __future__ import annotations

import dataclasses
import inspect
import typing
import uuid
from pathlib import Path
from typing import Literal

import dask.config
import dask.dataframe as dd
import pandas as pd
import pytest
import yaml

import dask_surge
from dask_surge import api, cli, config, options
from dask_surge.errors import SurgeOutputError, SurgeValueError
from dask_surge.execution.superbatch import SuperBatchTask
from dask_surge.models.encoders import Encoder
from dask_surge.models.spec import EncoderSpec
from dask_surge.options import Cli, Option, options_of
from dask_surge.planning.identity import IDENTITY_OPTIONS
from dask_surge.synthetic import make_partitioned_frame

SCHEMA_PATH = Path(config.DEFAULTS_PATH).with_name("surge-schema.yaml")
TYPED = {"encode": options.EncodeOptions, "plan": options.PlanOptions}


def _subparser(name: str):
    return cli.build_parser()._subparsers._group_actions[0].choices[name]


def _schema_drift() -> set[str]:
    """The config keys on which the shipped schema and the one the table gives differ."""
    shipped = yaml.safe_load(SCHEMA_PATH.read_text())["properties"]["surge"]["properties"]
    derived = options.schema()["properties"]["surge"]["properties"]
    return {k for k in set(shipped) | set(derived) if shipped.get(k) != derived.get(k)}


# -- the typed view, the runtime signature and the table agree ---------------------------------------


@pytest.mark.parametrize("taker", ["encode", "plan"])
def test_typeddict_signature_and_table_agree(taker):
    table = options_of(taker)
    hints = typing.get_type_hints(TYPED[taker])
    assert list(hints) and set(hints) == {o.name for o in table}, "add the option's line to the TypedDict"
    for opt in table:
        assert hints[opt.name] == opt.annotation, opt.name
    func = getattr(api, taker)
    params = list(inspect.signature(func).parameters.values())
    head = ["ddf", "column", "output"] if taker == "encode" else ["ddf", "column"]
    assert [p.name for p in params] == head + [o.name for o in table]
    for param, opt in zip(params[len(head) :], table):
        assert param.kind is inspect.Parameter.KEYWORD_ONLY
        assert param.default == opt.api_default and param.annotation == opt.annotation, opt.name
        assert param.default is None or not opt.config  # a config option resolves when the function runs


def test_overloads_differ_on_output_only():
    overloads = typing.get_overloads(api.encode)
    assert len(overloads) == 2
    full = inspect.signature(api.encode)
    for ov in overloads:
        sig = inspect.signature(ov)
        assert list(sig.parameters) == list(full.parameters)
        assert [p for p in sig.parameters.values() if p.name != "output"] == [
            p for p in full.parameters.values() if p.name != "output"
        ]
    assert {inspect.signature(ov).parameters["output"].annotation for ov in overloads} == {"None", "str"}


def test_accessor_shows_every_option_with_its_default():
    ddf = dd.from_pandas(pd.DataFrame({"text": ["a"]}), npartitions=1)
    for taker in ("encode", "plan"):
        params = inspect.signature(getattr(ddf.surge, taker)).parameters
        for opt in options_of(taker):
            assert params[opt.name].default == opt.api_default, (taker, opt.name)


def test_an_unknown_keyword_is_a_type_error_with_the_nearest_name():
    ddf = dd.from_pandas(pd.DataFrame({"text": ["a"]}), npartitions=1)
    with pytest.raises(
        TypeError, match=r"encode\(\) got an unexpected keyword argument 'normalise'.*'normalize'"
    ):
        ddf.surge.encode("text", normalise=True)
    with pytest.raises(TypeError, match=r"plan\(\) got an unexpected keyword argument 'overwrite'"):
        ddf.surge.plan("text", overwrite=True)  # an encode option plan does not take


@pytest.mark.parametrize("taker", ["encode", "plan"])
def test_every_option_is_documented_once_in_the_docstring(taker):
    doc = getattr(api, taker).__doc__
    assert "{options}" not in doc
    for opt in options_of(taker):
        assert doc.count(f"\n    {opt.name} : {opt.doc_type}\n") == 1, opt.name
        if opt.config:
            assert f"``surge.{opt.config}``" in doc


# -- Encoder --------------------------------------------------------------------------------------


def test_encoder_takes_the_declared_options_with_their_defaults():
    params = {
        p.name: p
        for p in inspect.signature(Encoder).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    table = {o.name: o for o in options_of("Encoder")}
    assert list(params) == list(table)
    for name, param in params.items():
        assert param.default == table[name].default, name
    spec = {f.name: f.default for f in dataclasses.fields(EncoderSpec) if f.name in table}
    assert spec.pop("model_kwargs") == ()  # frozen to a tuple of items (the option is None: none)
    assert spec == {k: o.default for k, o in table.items() if k not in ("revision", "model_kwargs")}


def test_one_validator_checks_the_argument_and_the_config_value():
    with pytest.raises(
        SurgeValueError, match=r"^batch_size=0 must be a positive int\. Fix: pass e\.g\. batch_size=32"
    ):
        Encoder("default", batch_size=0)
    with pytest.raises(
        SurgeValueError,
        match=r"^surge\.batch-size=0 is not allowed: must be a positive int\. Fix: "
        r"dask\.config\.set.*DASK_SURGE__BATCH_SIZE",
    ):
        config.get("batch-size", 0)
    with pytest.raises(SurgeValueError, match=r"device='gpu' is not a torch device.*Fix"):
        Encoder("default", device="gpu")
    with (
        dask.config.set({"surge.device": "gpu"}),
        pytest.raises(SurgeValueError, match=r"surge\.device='gpu'"),
    ):
        config.get("device")
    with pytest.raises(
        SurgeValueError, match=r"model_kwargs=\[\{'token': '\*\*\*'\}\] must be a dict or None"
    ) as err:
        Encoder("default", model_kwargs=[{"token": "hf_secret"}])
    assert "hf_secret" not in str(err.value)  # credentials redacted


def test_an_argument_only_option_is_checked_by_its_declaration(tmp_path):
    ddf = dd.from_pandas(pd.DataFrame({"text": ["a"]}), npartitions=1)
    with pytest.raises(
        SurgeValueError, match=r"overwrite='yes' must be True or False\. Fix: pass overwrite=True"
    ):
        ddf.surge.encode("text", str(tmp_path / "o"), overwrite="yes")
    assert not (tmp_path / "o").exists()


# -- the config: defaults, schema ---------------------------------------------------------------------


def test_shipped_defaults_are_the_declared_ones():
    shipped = yaml.safe_load(Path(config.DEFAULTS_PATH).read_text())["surge"]
    declared = options.config_options()
    assert list(shipped) and set(shipped) == set(declared)
    for key, value in shipped.items():
        assert value == declared[key].default, key
        assert declared[key].check(value) is not None or value is None


def test_shipped_schema_is_the_generated_one():
    assert _schema_drift() == set()
    assert SCHEMA_PATH.read_text() == options.schema_yaml(), (
        "regenerate: python -c \"from dask_surge.options import schema_yaml; print(schema_yaml(), end='')\" "
        "> dask_surge/surge-schema.yaml"
    )


SAMPLES = [
    None,
    True,
    False,
    0,
    -1,
    1,
    7,
    1.5,
    "auto",
    "x",
    "cpu",
    "cuda:1",
    "float16",
    "error",
    "zstd",
    "fast",
]


def test_schema_and_validators_agree():
    jsonschema = pytest.importorskip("jsonschema")
    for key, opt in options.config_options().items():
        rule = options.schema()["properties"]["surge"]["properties"][key]
        for value in SAMPLES:
            if key == "max-bytes" and isinstance(value, str):
                continue  # the schema takes any string; sizes are parsed when read ("512 MiB")
            by_schema = jsonschema.Draft7Validator(rule).is_valid(value)
            try:
                opt.check(value)
                by_validator = True
            except options.Invalid:
                by_validator = False
            assert by_schema == by_validator, (key, value)


# -- the fingerprint ----------------------------------------------------------------------------------


def test_identity_options_are_unchanged_by_the_table():
    assert dict(IDENTITY_OPTIONS) == {
        "ddf": True,
        "column": True,
        "output": False,
        "model": True,
        "b_min": False,
        "b_max": False,
        "max_bytes": False,
        "keep": True,
        "normalize": True,
        "precision": True,
        "truncate_dim": True,
        "sparse_top_k": True,
        "sparse_threshold": True,
        "on_null": False,
        "long_texts": True,
        "chunk_overlap": True,
        "reuse": False,
        "device": False,
        "dtype": True,
        "engine": False,
        "batch_size": False,
        "max_tokens": False,
        "prompt": True,
        "prompt_name": True,
        "revision": True,
        "trust_remote_code": False,
        "model_kwargs": True,
        "overwrite": False,
        "storage_options": False,
        "format": False,
        "mode": False,
        "iceberg_catalog": False,  # where the table is named, not what it holds
        "iceberg_table": False,
        "table": False,
        "build_index": False,  # an index follows the run; it never makes a different run
        "scheduler": False,
        "progress": False,
        "input_token": True,
    }


# -- the CLI ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("command,taker", [("encode", "encode"), ("demo", "encode"), ("plan", "plan")])
def test_cli_flags_come_from_the_table(command, taker):
    actions = {a.dest: a for a in _subparser(command)._actions}
    for opt in options_of(taker):
        if opt.cli is None:
            continue
        action = actions[opt.name]
        assert (opt.cli.flag or "--" + opt.name.replace("_", "-")) in action.option_strings
        assert action.choices == opt.choices
        assert action.default == opt.api_default, opt.name
    declared = {o.name for o in options_of(taker) if o.cli is not None}
    assert declared <= set(actions)


# -- adding an option is one declaration ----------------------------------------------------------------

Flavour = Literal["plain", "salted"]


@pytest.fixture
def flavour(monkeypatch):
    """A test-only option, declared once: it changes the embeddings, lives in the config and on the CLI."""
    declared = Option(
        "flavour",
        Flavour | None,
        '{"plain", "salted"}, optional',
        'Can be "plain", or "salted" to season every vector.',
        "how the vectors are seasoned",
        default="plain",
        config="flavour",
        vocabulary=Flavour,
        identity=True,
        takers=frozenset({"encode", "plan"}),
        cli=Cli(),
    )
    monkeypatch.setattr(options, "OPTIONS", (*options.OPTIONS, declared))
    api._derive_from_options()
    with dask.config.set({"surge.flavour": "plain"}):
        yield declared
    monkeypatch.undo()
    api._derive_from_options()


def test_a_new_option_is_one_declaration(flavour, tmp_path, counting_encoder):
    # the signature (the accessor's too) and the docstring
    for func in (api.encode, api.plan):
        assert inspect.signature(func).parameters["flavour"].default is None
        assert (
            '    flavour : {"plain", "salted"}, optional\n        Can be "plain", or "salted"' in func.__doc__
        )
    ddf = make_partitioned_frame([2, 2])
    assert "flavour" in inspect.signature(ddf.surge.encode).parameters
    # the CLI parser
    args = cli.build_parser().parse_args(
        ["encode", "in", "--text-column", "t", "--output", "o", "--flavour", "salted"]
    )
    assert cli._options(args)["flavour"] == "salted"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["plan", "in", "--text-column", "t", "--flavour", "sour"])
    # the config: validated by the declaration, and the schema check fails until the file is regenerated
    assert config.get("flavour") == "plain"
    with pytest.raises(SurgeValueError, match=r"surge\.flavour='sour' is not allowed"):
        config.get("flavour", "sour")
    assert _schema_drift() == {"flavour"}
    assert options.schema()["properties"]["surge"]["properties"]["flavour"]["enum"] == ["plain", "salted"]
    # the fingerprint: a different flavour is a different run, the default leaves existing runs alone
    assert IDENTITY_OPTIONS["flavour"] is True
    out = str(tmp_path / "emb")
    kw = {"model": counting_encoder, "scheduler": "sync", "progress": False, "b_min": 2, "b_max": 4}
    sbe = SuperBatchTask("text", (), Encoder(counting_encoder), on_null="error")
    frame = ddf[["text"]]
    base = api.fingerprint(frame, sbe, device="cpu")
    assert (
        api.fingerprint(frame, sbe, device="cpu", options={"flavour": None}) == base
    )  # the default: unchanged
    assert api.fingerprint(frame, sbe, device="cpu", options={"flavour": "salted"}) == {
        **base,
        "flavour": "salted",
    }
    assert ddf.surge.encode("text", out, **kw).rows == 4
    assert ddf.surge.encode("text", out, flavour="plain", **kw).resumed  # the same run
    with pytest.raises(SurgeOutputError, match=r"different run"):
        ddf.surge.encode("text", out, flavour="salted", **kw)
    assert len(dask_surge.read_embeddings(out).compute()) == 4


def test_the_declaration_is_gone_with_the_fixture():
    assert "flavour" not in inspect.signature(api.encode).parameters
    assert "flavour" not in IDENTITY_OPTIONS and _schema_drift() == set()


def test_a_type_checker_sees_the_typed_options(tmp_path):
    mypy_api = pytest.importorskip("mypy.api")
    user = tmp_path / f"user_{uuid.uuid4().hex}.py"  # a new module: never answered from mypy's cache
    user.write_text(
        "from typing import Any\n\nimport dask_surge\n\nddf: Any = None\n"
        "reveal_type(dask_surge.encode(ddf, 'text', 'out', precision='float16', b_min=5))\n"
        "dask_surge.encode(ddf, 'text', precision='float64')\n"
        "dask_surge.plan(ddf, 'text', token_sample='many')\n"
    )
    out, _, _ = mypy_api.run([str(user), "--ignore-missing-imports", "--hide-error-context", "--no-pretty"])
    assert 'Revealed type is "dask_surge.results.EncodeResult"' in out
    assert f"{user}:7: error: " in out, out  # precision='float64' is not a Precision
    assert f'{user}:8: error: Argument "token_sample" to "plan" has incompatible type "str"' in out
