"""The conversion rules language (`trainrec.conversion.rules`): every feature, every refusal, the
attention presets against real torch and flax modules."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import trainrec
from trainrec.conversion.rules import (
    PRESETS,
    TRANSFORMS,
    Plan,
    Rule,
    load_rules,
    plan_rules,
    register_transform,
)


def arrays(shapes, seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


def apply(plans, values):
    """Target arrays from source arrays, as an engine does with each plan."""
    return {t: p.fn([values[s] for s in p.sources]) for t, p in plans.items()}


def shapes(values):
    return {k: v.shape for k, v in values.items()}


def rules_file(tmp_path, *rules, name="r.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"rules": list(rules)}))
    return path


def one(tmp_path, rule):
    (r,) = load_rules(rules_file(tmp_path, rule))
    return r


# -- names -----------------------------------------------------------------------------------


def test_backreferences_numbered_and_named(tmp_path):
    rule = one(tmp_path, {"match": r"blocks\.(\d+)\.(?P<leaf>weight|bias)", "replace": r"params.layer_\1.\g<leaf>"})
    src = arrays({"blocks.0.weight": (2, 3), "blocks.1.bias": (3,), "other": (1,)})
    plans, problems = plan_rules([rule], shapes(src), {"params.layer_0.weight": (2, 3), "params.layer_1.bias": (3,)})
    assert problems == []
    assert {t: p.sources for t, p in plans.items()} == {"params.layer_0.weight": ("blocks.0.weight",),
                                                        "params.layer_1.bias": ("blocks.1.bias",)}
    out = apply(plans, src)
    assert np.array_equal(out["params.layer_0.weight"], src["blocks.0.weight"])
    assert "other" not in {s for p in plans.values() for s in p.sources}  # matched by nothing: in no plan
    assert isinstance(plans["params.layer_0.weight"], Plan) and plans["params.layer_0.weight"].shape == (2, 3)


def test_one_rule_with_a_name_map_renames_q_k_v(tmp_path):
    rule = one(tmp_path, {"match": r"(?P<m>.+)\.(?P<p>\w)_proj\.bias", "replace": r"params.\g<m>.\g<p>.bias",
                          "names": {"p": {"q": "query", "k": "key", "v": "value"}}})
    src = {f"attn.{p}_proj.bias": (4,) for p in "qkvx"}
    target = {f"params.attn.{n}.bias": (4,) for n in ("query", "key", "value")}
    plans, problems = plan_rules([rule], src, target)
    assert problems == []
    assert {t: p.sources[0] for t, p in plans.items()} == {
        "params.attn.query.bias": "attn.q_proj.bias", "params.attn.key.bias": "attn.k_proj.bias",
        "params.attn.value.bias": "attn.v_proj.bias"}  # x is not in the map: the rule does not match it
    numbered = Rule(r"(\w)\.w", r"\1.kernel", names={"1": {"a": "alpha"}})
    assert set(plan_rules([numbered], {"a.w": (1,)}, {"alpha.kernel": (1,)})[0]) == {"alpha.kernel"}


# -- layouts ---------------------------------------------------------------------------------


def test_rearrange_takes_axis_sizes_from_the_target(tmp_path):
    rule = one(tmp_path, {"match": "w", "replace": "k", "rearrange": "(h d) i -> i h d"})
    src = arrays({"w": (6, 5)})
    for heads in (2, 3):
        plans, problems = plan_rules([rule], shapes(src), {"k": (5, heads, 6 // heads)})
        assert problems == []
        want = src["w"].reshape(heads, 6 // heads, 5).transpose(2, 0, 1)
        assert np.array_equal(apply(plans, src)["k"], want)
    _, problems = plan_rules([rule], shapes(src), {"k": (5, 4, 2)})
    assert len(problems) == 1 and "w [6, 5] -> k [5, 4, 2]" in problems[0] and "(h d) i -> i h d" in problems[0]


def test_rearrange_axes_give_the_sizes_the_target_cannot(tmp_path):
    src = arrays({"w": (6, 5)})
    swap = {"match": "w", "replace": "k", "rearrange": "(h d) i -> i (d h)"}
    _, problems = plan_rules([one(tmp_path, swap)], shapes(src), {"k": (5, 6)})
    assert len(problems) == 1 and "w [6, 5] -> k [5, 6]" in problems[0]
    plans, problems = plan_rules([one(tmp_path, {**swap, "axes": {"h": 2}})], shapes(src), {"k": (5, 6)})
    assert problems == []
    want = src["w"].reshape(2, 3, 5).transpose(2, 1, 0).reshape(5, 6)
    assert np.array_equal(apply(plans, src)["k"], want)


def test_reshape_to_the_targets_shape(tmp_path):
    rule = one(tmp_path, {"match": "w", "replace": "k", "reshape": True})
    src = arrays({"w": (6, 4)})
    plans, problems = plan_rules([rule], shapes(src), {"k": (2, 3, 4)})
    assert problems == [] and np.array_equal(apply(plans, src)["k"], src["w"].reshape(2, 3, 4))
    _, problems = plan_rules([rule], shapes(src), {"k": (5, 5)})
    assert len(problems) == 1 and "24 elements, the target has 25" in problems[0]


def test_built_in_transforms_keep_their_names(tmp_path):
    src = arrays({"conv": (4, 2, 3, 3), "fc": (3, 5)})
    rules = [Rule("conv", "kernel", "oihw_to_hwio"), one(tmp_path, {"match": "fc", "replace": "fck",
                                                                    "transform": "transpose"})]
    plans, problems = plan_rules(rules, shapes(src), {"kernel": (3, 3, 2, 4), "fck": (5, 3)})
    assert problems == []
    out = apply(plans, src)
    assert np.array_equal(out["kernel"], src["conv"].transpose(2, 3, 1, 0))
    assert np.array_equal(out["fck"], src["fc"].T)
    assert {"none", "transpose", "oihw_to_hwio", "hwio_to_oihw", "oiw_to_wio", "wio_to_oiw"} <= set(TRANSFORMS)


def test_register_transform(tmp_path):
    register_transform("test_rules_flip", lambda a: a[::-1])
    register_transform("test_rules_halve", lambda a: a[: len(a) // 2], shape=lambda s: (s[0] // 2, *s[1:]))
    src = arrays({"a": (4,), "b": (6, 2)})
    rules = load_rules(rules_file(tmp_path, {"match": "a", "replace": "A", "transform": "test_rules_flip"},
                                  {"match": "b", "replace": "B", "transform": "test_rules_halve"}))
    plans, problems = plan_rules(rules, shapes(src), {"A": (4,), "B": (3, 2)})
    assert problems == []
    out = apply(plans, src)
    assert np.array_equal(out["A"], src["a"][::-1]) and np.array_equal(out["B"], src["b"][:3])
    with pytest.raises(ValueError, match="'test_rules_flip' is already registered"):
        register_transform("test_rules_flip", lambda a: a)
    with pytest.raises(ValueError, match="'transpose' is already registered"):
        register_transform("transpose", lambda a: a)
    with pytest.raises(TypeError, match="fn must be callable"):
        register_transform("test_rules_nothing", "a[::-1]")
    with pytest.raises(TypeError, match="shape must be callable"):
        register_transform("test_rules_nothing", lambda a: a, shape=(2,))
    with pytest.raises(TypeError, match="name must be a string"):
        register_transform(3, lambda a: a)
    with pytest.raises(ValueError, match="must not be empty"):
        register_transform("", lambda a: a)
    assert "test_rules_nothing" not in TRANSFORMS


def test_rule_stays_constructible_as_before():
    rule = Rule("fc1\\.weight", "params.fc1.kernel", "transpose")
    assert (rule.match, rule.replace, rule.transform) == ("fc1\\.weight", "params.fc1.kernel", "transpose")
    assert Rule("a", "b").transform == "none"
    with pytest.raises(ValueError, match="unknown transform 'rotate'"):
        Rule("x", "y", "rotate")


# -- one-to-many, many-to-one ----------------------------------------------------------------

SPLIT = {"match": r"(?P<m>.+)\.in_proj_weight", "rearrange": "(k h d) i -> k i h d",
         "targets": [r"\g<m>.q", r"\g<m>.k", r"\g<m>.v"]}
JOIN = {"sources": [r"(?P<m>.+)\.q", r"(?P<m>.+)\.k", r"(?P<m>.+)\.v"], "rearrange": "k i h d -> (k h d) i",
        "replace": r"\g<m>.in_proj_weight"}


def test_one_to_many_and_many_to_one_round_trip_exactly(tmp_path):
    split, join = one(tmp_path, SPLIT), one(tmp_path, JOIN)
    packed = arrays({"a.in_proj_weight": (24, 8), "b.in_proj_weight": (24, 8)})
    heads = {f"{m}.{p}": (8, 2, 4) for m in "ab" for p in "qkv"}
    plans, problems = plan_rules([split], shapes(packed), heads)
    assert problems == [] and set(plans) == set(heads)
    out = apply(plans, packed)
    w = packed["a.in_proj_weight"]
    assert np.array_equal(out["a.k"], w[8:16].reshape(2, 4, 8).transpose(2, 0, 1))  # the second third
    assert out["a.k"].flags.c_contiguous
    back, problems = plan_rules([join], shapes(out), shapes(packed))
    assert problems == []
    assert back["b.in_proj_weight"].sources == ("b.q", "b.k", "b.v")  # stacked in the rule's order
    again = apply(back, out)
    for name in packed:
        assert np.array_equal(again[name], packed[name]), name


def test_many_to_one_starts_from_any_of_its_sources_and_takes_them_all(tmp_path):
    join = one(tmp_path, JOIN)
    src = {"x.v": (8, 2, 4), "x.k": (8, 2, 4), "x.q": (8, 2, 4)}  # v first
    fallback = Rule(r".+\.[qkv]", "never")
    plans, problems = plan_rules([join, fallback], src, {"x.in_proj_weight": (24, 8)})
    assert problems == [] and plans["x.in_proj_weight"].sources == ("x.q", "x.k", "x.v")


def test_a_many_to_one_rule_names_its_target_from_its_first_source():
    """Numbered groups are those of the first expression, whichever source starts the rule."""
    join = Rule((r"(?P<m>\w+)\.q(\d)", r"(?P<m>\w+)\.k"), r"\g<m>.qk\2", reshape=True)
    plans, problems = plan_rules([join], {"x.k": (2,), "x.q7": (2,)}, {"x.qk7": (4,)})
    assert problems == [] and plans["x.qk7"].sources == ("x.q7", "x.k")


def test_a_many_to_one_rule_missing_a_source_is_a_problem_or_passed_over(tmp_path):
    join = one(tmp_path, JOIN)
    src = {"x.q": (8, 2, 4), "x.k": (8, 2, 4)}
    _, problems = plan_rules([join], src, {"x.in_proj_weight": (24, 8)})
    assert problems and "x.q" in problems[0] and "sources[2]" in problems[0]
    plans, problems = plan_rules([join], src, {"x.in_proj_weight": (24, 8)}, strict=False)
    assert (plans, problems) == ({}, [])


def test_sources_a_many_to_one_rule_cannot_tell_apart_are_a_problem():
    vague = Rule((r"(.+)\.q", r"(.+)\.k"), "joined", rearrange="k i -> (k i)")
    _, problems = plan_rules([vague], {"a.q": (2,), "a.k": (2,), "b.k": (2,)}, {"joined": (4,)}, strict=False)
    assert problems and "alike" in problems[0] and "named groups" in problems[0]


def test_sources_and_targets_of_different_shapes_are_problems(tmp_path):
    _, problems = plan_rules([one(tmp_path, JOIN)], {"x.q": (8, 2, 4), "x.k": (8, 2, 4), "x.v": (8, 4, 2)},
                             {"x.in_proj_weight": (24, 8)})
    assert problems and "sources differ in shape" in problems[0]
    _, problems = plan_rules([one(tmp_path, SPLIT)], {"x.in_proj_weight": (24, 8)},
                             {"x.q": (8, 2, 4), "x.k": (8, 2, 4), "x.v": (8, 4, 2)})
    assert problems and "targets differ in shape" in problems[0]


# -- strictness, order, frameworks -----------------------------------------------------------


def test_strict_rules_report_what_presets_pass_over():
    rules = [Rule("w", "missing"), Rule("w", "k", "transpose"), Rule("w", "k")]
    src, target = {"w": (2, 3)}, {"k": (3, 2)}
    plans, problems = plan_rules(rules, src, target)
    assert plans == {} and problems == ["w: rule 0 maps it to missing, which the target does not have"]
    plans, problems = plan_rules(rules, src, target, strict=False)
    assert problems == [] and plans["k"].why == "rule 1 transform 'transpose'"
    plans, problems = plan_rules([Rule("w", "k"), rules[1]], src, target, strict=False)  # shape misfit: next
    assert problems == [] and plans["k"].why == "rule 1 transform 'transpose'"


def test_two_plans_for_one_target_are_a_problem():
    _, problems = plan_rules([Rule("[ab]", "k")], {"a": (2,), "b": (2,)}, {"k": (2,)}, strict=False)
    assert len(problems) == 1 and "k: made by rule 0 from a and by rule 0 from b" == problems[0]


def test_from_and_to_restrict_a_rule_to_frameworks(tmp_path):
    rules = load_rules(rules_file(tmp_path, {"match": "w", "replace": "a", "from": "torch", "to": "jax"},
                                  {"match": "w", "replace": "b", "from": "jax"}, {"match": "w", "replace": "c"}))
    target = {"a": (1,), "b": (1,), "c": (1,)}
    for frameworks, made in [(("torch", "jax"), "a"), (("jax", "torch"), "b"), (("torch", "mlx"), "c"),
                             (("jax", "mlx"), "b"), (None, "a")]:
        plans, problems = plan_rules(rules, {"w": (1,)}, target, frameworks=frameworks)
        assert problems == [] and list(plans) == [made], frameworks


# -- rule files ------------------------------------------------------------------------------


@pytest.mark.parametrize(("rule", "named"), [
    ({"replace": "x"}, "rules[0]: missing 'match'"),
    ({"match": "(", "replace": "x"}, "rules[0]: match '(' is not a regular expression"),
    ({"match": "a", "replace": "b", "colour": "red"}, "rules[0]: unknown key 'colour'"),
    ({"match": "a", "replace": "b", "transform": "flip"}, "rules[0]: unknown transform 'flip'"),
    ({"match": "a", "replace": 3}, "rules[0]: 'replace' must be a string"),
    ({"match": "a", "replace": "b", "rearrange": "(h d -> h d"}, "rules[0]: rearrange '(h d -> h d' is not an einops"),
    ({"match": "a", "replace": "b", "rearrange": "h d"}, "expected one '->'"),
    ({"match": "a", "replace": "b", "rearrange": "h d -> h c"}, "axes only on one side: ['c', 'd']"),
    ({"match": "a", "replace": "b", "rearrange": "h d -> d h", "transform": "transpose"},
     "rules[0]: 'rearrange' and 'transform' together: at most one"),
    ({"match": "a", "replace": "b", "reshape": True, "transform": "transpose"}, "'reshape' and 'transform' together"),
    ({"match": "a", "replace": "b", "reshape": "yes"}, "'reshape' must be true or false"),
    ({"match": "(a)", "replace": r"\2"}, r"rules[0]: replace '\\2': '\\2': no such group"),
    ({"match": "(?P<m>a)", "replace": r"\g<n>"}, "no such group"),
    ({"match": "a", "replace": r"\n"}, "bad escape"),
    ({"match": "a", "replace": "b", "names": {"p": {"q": "query"}}}, "names['p']: no such group in match"),
    ({"match": "(?P<p>a)", "replace": "b", "names": {"p": ["q"]}}, "names['p'] must be a map"),
    ({"match": "(?P<p>a)", "replace": "b", "names": ["p"]}, "'names' must be a map"),
    ({"match": "a", "replace": "b", "axes": {"h": 2}}, "'axes' without 'rearrange'"),
    ({"match": "a", "replace": "b", "rearrange": "h d -> d h", "axes": {"x": 2}}, "axes ['x'] are not in the pattern"),
    ({"match": "a", "replace": "b", "rearrange": "h d -> d h", "axes": {"h": 0}}, "sizes > 0"),
    ({"match": "a", "sources": ["a", "b"], "replace": "c"}, "'match' and 'sources' together"),
    ({"sources": ["a"], "replace": "c"}, "'sources' needs two"),
    ({"match": "a", "targets": ["b"]}, "'targets' needs two"),
    ({"sources": ["a", "b"], "targets": ["c", "d"]}, "'sources' and 'targets' together"),
    ({"sources": ["(?P<m>a)", "b"], "replace": "c"}, "same named groups"),
    ({"sources": ["a", "("], "replace": "c"}, "sources[1] '(' is not a regular expression"),
    ({"match": "a", "replace": "b", "from": 1}, "'from' must be a string"),
    ("fc1.weight", "rules[0]: expected a map"),
])
def test_bad_rules_are_refused_naming_the_rule_and_field(tmp_path, rule, named):
    path = rules_file(tmp_path, {"match": "fine", "replace": "ok"}, rule)
    with pytest.raises(ValueError) as refused:
        load_rules(path)
    assert named.replace("rules[0]", "rules[1]") in str(refused.value) and str(path) in str(refused.value)


def test_every_bad_rule_is_named_at_once(tmp_path):
    path = rules_file(tmp_path, {"match": "(", "replace": "x"}, {"match": "a", "replace": "b"},
                      {"match": "a", "replace": "b", "transform": "flip", "shape": 3})
    with pytest.raises(ValueError) as refused:
        load_rules(path)
    text = str(refused.value)
    assert "rules[0]: match '('" in text and "rules[2]: unknown key 'shape'" in text and "rules[1]" not in text


@pytest.mark.parametrize(("content", "named"), [
    ("{not json", "not JSON"), ('{"rule": []}', 'expected {"rules": [...]}'), ("[1]", 'expected {"rules"'),
    ('{"rules": [], "version": 2}', "unknown key 'version'"),
])
def test_a_rules_file_that_is_no_rules_file_is_refused(tmp_path, content, named):
    path = tmp_path / "r.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("{", r"\{")):
        load_rules(path)


def test_a_file_may_describe_itself_and_its_rules(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"description": "renames", "rules": [
        {"comment": "the head", "match": "head", "replace": "out"}]}))
    (rule,) = load_rules(path)
    assert rule.origin == f"{path}: rules[0]"
    assert plan_rules([rule], {"head": (1,)}, {"out": (1,)})[0]["out"].why == f"{path}: rules[0]"


def test_a_pattern_that_cannot_make_the_target_names_source_target_and_shapes(tmp_path):
    rule = one(tmp_path, {"match": "w", "replace": "k", "rearrange": "(h d) i -> i h d"})
    _, problems = plan_rules([rule], {"w": (7, 5)}, {"k": (5, 2, 3)})
    assert len(problems) == 1
    assert problems[0].startswith(f"w [7, 5] -> k [5, 2, 3]: {tmp_path / 'r.json'}: rules[0] '(h d) i -> i h d'")


def test_presets_load_by_name():
    assert load_rules("attention") == PRESETS["attention"]
    assert PRESETS["attention"][0].origin == "preset 'attention': rules[0]"


def test_cli_rules_files_repeat_and_map_is_a_deprecated_alias(tmp_path):
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    fnn = pytest.importorskip("flax.linen")
    import trainrec
    import trainrec.adapters.jax as trj

    @trainrec.record
    class S:
        micro: int

    torch.manual_seed(0)
    net = torch.nn.Sequential()
    net.add_module("fc", torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(net.parameters())
    native = trainrec.NamedMpkFileRecorder(trainrec.NativePrecisionSettings())
    trainrec.TrainingRecord.capture(net, opt, None, trainrec.GradientsAccumulator(), S(0)).save(
        native, tmp_path / "src.mpk")
    variables = fnn.Dense(2, name="dense").init(jax.random.PRNGKey(0), np.zeros((1, 3), np.float32))
    variables = {"params": {"dense": variables["params"]}}
    tx = optax.adamw(1e-3, weight_decay=0.01)  # torch AdamW's maths
    trainrec.TrainingRecord.capture(trj.JaxModule(variables), trj.JaxOptimizer(tx, tx.init(variables["params"])),
                                    None, trainrec.GradientsAccumulator(), S(0)).save(native, tmp_path / "t.mpk")
    weight = rules_file(tmp_path, {"match": r"fc\.weight", "replace": "params.dense.kernel",
                                   "transform": "transpose"}, name="w.json")
    bias = rules_file(tmp_path, {"match": r"fc\.(bias)", "replace": r"params.dense.\1"}, name="b.json")

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "trainrec", "convert", str(tmp_path / "src.mpk"),
                               str(tmp_path / "dst.mpk"), "--to", "jax", "--template", str(tmp_path / "t.mpk"),
                               *map(str, args)], capture_output=True, text=True)

    unmapped = cli("--rules", weight)
    assert unmapped.returncode == 4 and "fc.bias" in unmapped.stderr
    done = cli("--rules", weight, "--rules", bias)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    got = trainrec.TrainingRecord.load(native, tmp_path / "dst.mpk").model.item
    assert np.array_equal(got["params.dense.kernel"].array, net.fc.weight.detach().numpy().T)
    assert np.array_equal(got["params.dense.bias"].array, net.fc.bias.detach().numpy())
    both = rules_file(tmp_path, json.loads(weight.read_text())["rules"][0], json.loads(bias.read_text())["rules"][0])
    old = cli("--map", both)
    assert old.returncode == 0 and "--map is deprecated, use --rules" in old.stderr
    bad = cli("--rules", rules_file(tmp_path, {"match": "a", "replace": "b", "rearrange": "x ->"}, name="x.json"))
    assert bad.returncode == 3 and "x.json: rules[0]: rearrange 'x ->'" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    missing = cli("--rules", tmp_path / "nope.json")
    assert missing.returncode == 3 and "nope.json" in missing.stderr
    os.mkfifo(tmp_path / "fifo")  # would block a read forever
    fifo = subprocess.run([sys.executable, "-m", "trainrec", "convert", str(tmp_path / "src.mpk"),
                           str(tmp_path / "dst.mpk"), "--to", "jax", "--template", str(tmp_path / "t.mpk"),
                           "--rules", str(tmp_path / "fifo")], capture_output=True, text=True, timeout=60)
    assert fifo.returncode == 3 and "not a regular file" in fifo.stderr


# -- the attention presets on real modules ---------------------------------------------------

E, HEADS, L = 8, 2, 5


def _torch_qkv(torch):
    class QKV(torch.nn.Module):
        """Attention with separate q/k/v/out Linear layers (as in many torch models)."""

        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj, self.out_proj = (torch.nn.Linear(E, E) for _ in range(4))

        def forward(self, x):
            b = x.shape[0]

            def heads(t):
                return t.view(b, L, HEADS, E // HEADS).transpose(1, 2)

            o = torch.nn.functional.scaled_dot_product_attention(
                heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
            return self.out_proj(o.transpose(1, 2).reshape(b, L, E))

    return QKV()


def _torch_attention(torch, kind):
    torch.manual_seed(0)
    net = torch.nn.Module()
    if kind == "multihead":
        mha = torch.nn.MultiheadAttention(E, HEADS, batch_first=True)
        net.attn = mha
        return net, lambda x: mha(x, x, x, need_weights=False)[0]
    net.attn = _torch_qkv(torch)
    return net, net.attn


def _flax_attention():
    import flax.linen as fnn
    import jax

    class Net(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            return fnn.MultiHeadDotProductAttention(num_heads=HEADS, name="attn")(x)

    variables = Net().init(jax.random.PRNGKey(1), np.zeros((1, L, E), np.float32))
    flat = {"params." + ".".join(str(k.key) for k in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(variables["params"])[0]}
    return Net(), flat


def _nest(flat):
    out = {}
    for name, value in flat.items():
        *path, leaf = name.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


@pytest.mark.parametrize("kind", ["multihead", "qkv-linear"])
def test_attention_presets_reproduce_flax_from_torch_and_torch_from_flax(kind):
    torch = pytest.importorskip("torch")
    pytest.importorskip("flax")
    net, torch_fn = _torch_attention(torch, kind)
    flax_net, flax_params = _flax_attention()
    torch_params = {k: v.detach().numpy() for k, v in net.state_dict().items()}
    x = np.random.default_rng(2).normal(size=(3, L, E)).astype(np.float32)

    plans, problems = plan_rules(PRESETS["attention"], shapes(torch_params), shapes(flax_params),
                                 frameworks=("torch", "jax"), strict=False)
    assert problems == [] and set(plans) == set(flax_params)
    converted = apply(plans, torch_params)
    flax_out = np.asarray(flax_net.apply(_nest(converted), x))
    with torch.no_grad():
        torch_out = torch_fn(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(flax_out, torch_out, rtol=1e-5, atol=1e-5)

    back, problems = plan_rules(PRESETS["attention"], shapes(converted), shapes(torch_params),
                                frameworks=("jax", "torch"), strict=False)
    assert problems == [] and set(back) == set(torch_params)
    again = apply(back, converted)
    assert all(np.array_equal(again[k], torch_params[k]) for k in torch_params)  # exactly, there and back

    plans, _ = plan_rules(PRESETS["attention"], shapes(flax_params), shapes(torch_params),
                          frameworks=("jax", "torch"), strict=False)
    net.load_state_dict({k: torch.tensor(v) for k, v in apply(plans, flax_params).items()})
    with torch.no_grad():
        torch_out = torch_fn(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(torch_out, np.asarray(flax_net.apply(_nest(flax_params), x)), rtol=1e-5, atol=1e-5)


def test_attention_presets_leave_other_layers_to_the_next_rules():
    """A flax Dense named `out` (2-D kernel) is no attention output: the preset passes over it."""
    plans, problems = plan_rules(PRESETS["attention"], {"params.out.kernel": (4, 3), "params.out.bias": (3,)},
                                 {"out.weight": (3, 4), "out.bias": (3,)}, frameworks=("jax", "torch"),
                                 strict=False)
    assert (plans, problems) == ({}, [])


# -- rules say what they did (issue 23) -------------------------------------------------------


def test_indices_write_list_indices_each_sides_way(tmp_path):
    from trainrec.conversion.rules import _reindexed

    assert _reindexed("blocks.0.attn.", "flax") == "blocks_0.attn."
    assert _reindexed("enc.layers.11.0.", "flax") == "enc.layers_11_0."
    assert _reindexed("0.attn.", "flax") == "0.attn."  # an index at the root has no name to carry it
    assert _reindexed("blocks_0.attn.", "dotted") == "blocks.0.attn."
    rule = one(tmp_path, {"match": r"(?P<m>.+\.)w", "indices": {"m": "flax"}, "replace": r"params.\g<m>k"})
    plans, problems = plan_rules([rule], {"blocks.3.w": (1,), "layer_1.w": (1,)},
                                 {"params.blocks_3.k": (1,), "params.layer_1.k": (1,)})
    assert problems == [] and {p.target: p.sources for p in plans.values()} == {
        "params.blocks_3.k": ("blocks.3.w",), "params.layer_1.k": ("layer_1.w",)}
    back = one(tmp_path, {"match": r"params\.(?P<m>.+\.)k", "indices": {"m": "dotted"}, "replace": r"\g<m>w"})
    plans, problems = plan_rules([back], {"params.blocks_3.k": (1,), "params.layer_1.k": (1,)},
                                 {"blocks.3.w": (1,), "layer_1.w": (1,)})  # layer_1 is torch's own name too
    assert problems == [] and set(plans) == {"blocks.3.w", "layer_1.w"}


@pytest.mark.parametrize(("rule", "named"), [
    ({"match": "(?P<m>a)", "replace": "b", "indices": {"m": "linen"}}, "indices['m']: 'linen' is not one of"),
    ({"match": "a", "replace": "b", "indices": {"m": "flax"}}, "indices['m']: no such group"),
    ({"match": "a", "replace": "b", "optional": "yes"}, "'optional' must be true or false"),
    ({"drop": "a", "replace": "b"}, "unknown key 'replace' (a drop rule holds 'drop'"),
    ({"keep": 3}, "'keep' must be a string"),
    ({"drop": "("}, "match '(' is not a regular expression"),
    ({"match": "a", "replace": "b", "to": "jaxx"}, "'to': 'jaxx' names no neutral form; known: ["),
    ({"match": "a", "replace": "b", "from": "tf"}, "'from': 'tf' names no neutral form"),
])
def test_bad_new_rule_keys_are_refused(tmp_path, rule, named):
    with pytest.raises(ValueError) as refused:
        load_rules(rules_file(tmp_path, rule))
    assert named in str(refused.value), str(refused.value)


def test_an_adapters_name_is_an_alias_of_its_form(tmp_path):
    """`"to": "flax"` (an adapter's name, as spec/CONVERSION.md allows) is the linen form
    `jax`: it applies (it used to load and never apply); `numpy` is `trainrec.numpy`."""
    (rule,) = load_rules(rules_file(tmp_path, {"match": "w", "replace": "k", "from": "pytorch", "to": "flax"}))
    assert (rule.from_, rule.to) == ("torch", "jax")
    assert list(plan_rules([rule], {"w": (1,)}, {"k": (1,)}, frameworks=("torch", "jax"))[0]) == ["k"]
    (rule,) = load_rules(rules_file(tmp_path, {"match": "w", "replace": "k", "to": "numpy"}))
    assert rule.to == "trainrec.numpy"
    with pytest.raises(ValueError, match="'to': 'jaxx' names no neutral form; known: .*'flax.nnx', 'jax'"):
        load_rules(rules_file(tmp_path, {"match": "w", "replace": "k", "to": "jaxx"}))


def _tied(torch, buffer=True):
    """torch: an embedding, a head tied to it (stored once), a constant buffer."""
    net = torch.nn.Module()
    net.tok, net.head = torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False)
    net.head.weight = net.tok.weight
    if buffer:
        net.register_buffer("causal_mask", torch.ones(4, 4))
    return net


@trainrec.record
class _S:
    micro: int


def _records(buffer=True, seed=0):
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    fnn = pytest.importorskip("flax.linen")
    import trainrec.adapters.jax as trj

    torch.manual_seed(seed)
    net = _tied(torch, buffer)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    torch_record = trainrec.TrainingRecord.capture(net, opt, None, trainrec.GradientsAccumulator(), _S(0))

    class Untied(fnn.Module):  # the flax model keeps its own head
        @fnn.compact
        def __call__(self, tok):
            return fnn.Dense(5, use_bias=False, name="head")(fnn.Embed(5, 3, name="tok")(tok))

    variables = Untied().init(jax.random.PRNGKey(seed), np.zeros((1, 2), np.int32))
    tx = optax.adamw(1e-2, weight_decay=0.01)
    flax_record = trainrec.TrainingRecord.capture(trj.JaxModule(variables),
                                                  trj.JaxOptimizer(tx, tx.init(variables["params"])), None,
                                                  trainrec.GradientsAccumulator(), _S(0))
    return torch_record, flax_record


def test_drop_and_keep_rules_say_what_is_not_converted(tmp_path):
    """A constant buffer the other side lacks, and a tied torch head into an untied flax
    head: refused naming both (each with the rule kind that says it), then converted with
    a drop and a keep rule, both listed in the report. And the way back."""
    from trainrec.conversion.convert import ConversionError, convert, convert_with_report

    torch_record, flax_record = _records()
    with pytest.raises(ConversionError) as refused:
        convert(torch_record, flax_record)
    text = str(refused.value)
    assert 'causal_mask: no target among its neutral names (none) (a {"drop": ...} rule drops it)' in text
    assert 'target params.head.kernel: no source tensor maps to it (a {"keep": ...} rule keeps' in text
    rules = load_rules(rules_file(tmp_path, {"drop": r"causal_mask"}, {"keep": r"params\.head\.kernel"}))
    out, report = convert_with_report(torch_record, flax_record, rules=rules)
    assert report.dropped == {"causal_mask": f"{tmp_path / 'r.json'}: rules[0] (drop)"}
    assert report.kept == {"params.head.kernel": f"{tmp_path / 'r.json'}: rules[1] (keep)"}
    assert np.array_equal(out.model.item["params.head.kernel"].array, flax_record.model.item["params.head.kernel"].array)
    assert any(line.startswith(f"{tmp_path / 'r.json'}: rules[0] (drop): dropped causal_mask") for line in report.rules)
    back_rules = load_rules(rules_file(tmp_path, {"drop": r"params\.head\.kernel"}, {"keep": "causal_mask"},
                                       name="back.json"))
    back, report = convert_with_report(out, torch_record, rules=back_rules)
    assert set(report.dropped) == {"params.head.kernel"} and set(report.kept) == {"causal_mask"}
    assert np.array_equal(back.model.item["tensors"]["tok.weight"].array,
                          torch_record.model.item["tensors"]["tok.weight"].array)


def test_a_rule_that_decides_no_tensor_is_refused_unless_optional(tmp_path):
    from trainrec.conversion.convert import ConversionError, convert

    torch_record, flax_record = _records()
    base = [{"drop": "causal_mask"}, {"keep": r"params\.head\.kernel"}]
    nothing = load_rules(rules_file(tmp_path, *base, {"match": r"encoder\..*", "replace": "params.x"}))
    with pytest.raises(ConversionError, match=r"rules\[2\] decided no tensor: it matches no source tensor"):
        convert(torch_record, flax_record, rules=nothing)
    optional = load_rules(rules_file(tmp_path, *base, {"match": r"encoder\..*", "replace": "params.x",
                                                      "optional": True}))
    convert(torch_record, flax_record, rules=optional)
    shadowed = load_rules(rules_file(tmp_path, *base, {"drop": "causal_.*"}))
    with pytest.raises(ConversionError, match=r"rules\[2\] \(drop\) decided no tensor: it matches causal_mask, "
                                              "which earlier rules decided"):
        convert(torch_record, flax_record, rules=shadowed)
    kept = load_rules(rules_file(tmp_path, *base, {"keep": r"params\.tok\.embedding"}, {"drop": r"tok\.weight"}))
    out = convert(torch_record, flax_record, rules=kept)  # the template's embedding, as asked
    assert np.array_equal(out.model.item["params.tok.embedding"].array,
                          flax_record.model.item["params.tok.embedding"].array)
    with pytest.raises(ConversionError, match=r"params\.tok\.embedding: made by .*rules\[0\] .* and kept by"):
        convert(torch_record, flax_record, rules=load_rules(rules_file(
            tmp_path, {"match": r"tok\.weight", "replace": "params.tok.embedding"}, *base,
            {"keep": r"params\.tok\.embedding"})))
    with pytest.raises(ValueError, match="'to': 'jaxx' names no neutral form"):
        convert(torch_record, flax_record, rules=[Rule("w", "k", to="jaxx")])


def test_an_unmapped_tensor_says_which_rules_were_not_tried(tmp_path):
    from trainrec.conversion.convert import ConversionError, convert

    torch_record, flax_record = _records()
    rules = load_rules(rules_file(tmp_path, {"drop": "causal_mask", "to": "flax.nnx"}))
    with pytest.raises(ConversionError, match=r"1 of the rules given are not for torch -> jax and were not tried: "
                                              r".*rules\[0\] \(drop\) \(from any, to flax.nnx\)"):
        convert(torch_record, flax_record, rules=rules)


def test_cli_explain_lists_what_each_rule_did(tmp_path):
    torch_record, flax_record = _records()
    native = trainrec.NamedMpkFileRecorder(trainrec.NativePrecisionSettings())
    torch_record.save(native, tmp_path / "s.mpk")
    flax_record.save(native, tmp_path / "t.mpk")
    rules = rules_file(tmp_path, {"drop": r"causal_mask"}, {"keep": r"params\.head\.kernel"},
                       {"match": "nothing", "replace": "x", "optional": True},
                       {"match": "w", "replace": "x", "from": "jax"})
    done = subprocess.run([sys.executable, "-m", "trainrec", "convert", str(tmp_path / "s.mpk"),
                           str(tmp_path / "d.mpk"), "--to", "jax", "--template", str(tmp_path / "t.mpk"),
                           "--rules", str(rules), "--explain"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[0] == "torch -> jax"
    assert f"rule {rules}: rules[0] (drop): dropped causal_mask" in out
    assert f"rule {rules}: rules[1] (keep): kept params.head.kernel" in out
    assert f"rule {rules}: rules[2]: decided no tensor (optional)" in out
    assert f"rule {rules}: rules[3]: not for torch -> jax (from jax, to any)" in out
    assert "params.tok.embedding <- tok.weight: neutral names" in out
    assert f"dropped causal_mask: {rules}: rules[0] (drop)" in out
    assert "state: untyped (neither record has a state type)" in out  # files hold no Python types


def test_the_readmes_rules_file_loads_and_does_what_it_says():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = [b for b in re.findall(r"^```json\n(.*?)^```", text, re.M | re.S) if '"rules"' in b]
    assert blocks
    rules = [r for b in blocks for r in load_rules_text(b)]
    source = {"blocks.1.attn.q_proj.weight": (4, 4), "blocks.0.attn.in_proj_weight": (12, 4),
              "blocks.0.causal_mask": (5, 5)}
    target = {"params.blocks_1.attn.query.kernel": (4, 2, 2), **{
        f"params.blocks_0.attn.{p}.kernel": (4, 2, 2) for p in ("query", "key", "value")}}
    from trainrec.conversion.rules import apply_rules

    done = apply_rules(rules, source, target)
    assert done.problems == [] and set(done.plans) == set(target) and set(done.dropped) == {"blocks.0.causal_mask"}


def load_rules_text(text):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "readme.json"
        path.write_text(text)
        return load_rules(path)
