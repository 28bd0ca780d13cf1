"""The wire contract without a network: committed generated code is current, and every conversion in
``datastore.wire`` round-trips or refuses a bad request with a message naming the field."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rest_spec.common.types import MAX_BUDGET, MAX_DEPTH, MAX_SUFFIX, DraftConfig, DraftTree, IndexInfo, ShardInfo
from rest_spec.datastore import wire
from rest_spec.proto import generate
from rest_spec.proto.v1 import datastore_pb2 as pb
from tests.tiers import examples


def test_committed_generated_code_is_what_the_generator_writes(tmp_path):
    written = generate.generate(tmp_path)
    assert len(written) == 3 * len(generate.PROTOS)  # _pb2.py, _pb2.pyi, _pb2_grpc.py each
    for path in written:
        committed = generate.PROTO_DIR / path.relative_to(tmp_path)
        assert path.read_bytes() == committed.read_bytes(), (
            f"{committed} is stale: run python -m rest_spec.proto.generate"
        )


def test_the_generated_code_asks_for_the_grpcio_pyproject_admits():
    pyproject = (generate.PROTO_DIR.parent / "pyproject.toml").read_text()
    assert f'"grpcio>={generate.GRPC_FLOOR}"' in pyproject
    for proto in generate.PROTOS:
        grpc_module = (generate.PROTO_DIR / proto.replace(".proto", "_pb2_grpc.py")).read_text()
        assert f"GRPC_GENERATED_VERSION = '{generate.GRPC_FLOOR}'" in grpc_module


def test_generated_imports_use_the_installed_name():
    grpc_module = (generate.PROTO_DIR / "v1/datastore_pb2_grpc.py").read_text()
    assert "from rest_spec.proto.v1 import datastore_pb2" in grpc_module


def test_every_stock_generator_gets_its_package_option():
    options = pb.DESCRIPTOR.GetOptions()
    assert options.go_package.endswith(";datastorev1") and options.java_package and options.csharp_namespace


@st.composite
def trees(draw):
    """Valid trees: a child's count at most its parent's and all at most num_sampled; scores
    derived from counts, or explicit (as merged trees carry) and never growing down a path."""
    n = draw(st.integers(0, 40))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
    num_sampled = draw(st.integers(0, 2**63 - 1))
    counts: list[int] = []
    for parent in parents:
        counts.append(draw(st.integers(0, counts[parent] if parent >= 0 else num_sampled)))
    scores = None
    if draw(st.booleans()):
        scores = []
        for parent in parents:
            scores.append(draw(st.floats(0, scores[parent] if parent >= 0 else 1)))
    return DraftTree(
        np.array(tokens, np.int32),
        np.array(parents, np.int32),
        np.array(counts, np.int64),
        match_len=draw(st.integers(0, MAX_SUFFIX)),
        num_matches=draw(st.integers(num_sampled, 2**63 - 1)),
        num_sampled=num_sampled,
        scores=scores,
    )


@settings(max_examples=examples(200), deadline=None)
@given(tree=trees())
def test_tree_round_trips_through_serialized_message(tree):
    data = wire.tree_to_message(tree).SerializeToString()
    message = pb.DraftTree.FromString(data)
    assert wire.tree_from_message(message) == tree  # scores included, exactly


def test_tree_from_a_writer_without_exact_scores_derives_them():
    """A message from a writer that predates field 8: counts, and the float32 copy in the now
    reserved field 4, which is skipped."""
    old = pb.DraftTree(tokens=[5, 6], parents=[-1, 0], counts=[3, 1], num_sampled=4).SerializeToString()
    field_4 = bytes([4 << 3 | 2, 8]) + np.array([0.75, 0.25], "<f4").tobytes()  # packed repeated float
    tree = wire.tree_from_message(pb.DraftTree.FromString(old + field_4))
    np.testing.assert_array_equal(tree.scores, [0.75, 0.25])


def test_explicit_scores_of_the_wrong_length_are_refused():
    with pytest.raises(ValueError, match="scores"):
        wire.tree_from_message(pb.DraftTree(tokens=[1, 2], parents=[-1, 0], counts=[1, 1], scores=[0.5]))


def test_empty_tree_is_the_default_message():
    """ "Not found" costs no bytes, and a reply without a tree decodes to the empty tree."""
    assert wire.tree_to_message(DraftTree.empty()).SerializeToString() == b""
    assert wire.tree_from_message(pb.DraftReply().tree) == DraftTree.empty()


def test_malformed_tree_message_is_refused():
    with pytest.raises(ValueError, match="parent"):
        wire.tree_from_message(pb.DraftTree(tokens=[1, 2], parents=[1, -1], counts=[1, 1]))


@given(
    budget=st.integers(1, MAX_BUDGET),
    max_depth=st.integers(1, MAX_DEPTH),
    n=st.tuples(st.integers(1, MAX_SUFFIX), st.integers(1, MAX_SUFFIX)).map(sorted),
)
def test_config_round_trips(budget, max_depth, n):
    config = DraftConfig(budget=budget, max_depth=max_depth, n_min=n[0], n_max=n[1])
    message = pb.DraftParams.FromString(wire.params_to_message(config).SerializeToString())
    assert wire.config_from_message(message) == config


def test_unset_params_are_the_documented_defaults():
    assert wire.config_from_message(pb.DraftParams()) == DraftConfig(budget=64, max_depth=10, n_max=16, n_min=2)
    assert wire.config_from_message(pb.DraftParams(budget=5)) == DraftConfig(budget=5)


def test_budget_zero_is_not_a_config():
    # 0 is the wire's "server default", so no DraftConfig may carry it
    with pytest.raises(ValueError, match="budget"):
        DraftConfig(budget=0)


@pytest.mark.parametrize(
    "params, field",
    [
        (pb.DraftParams(budget=MAX_BUDGET + 1), "budget"),
        (pb.DraftParams(max_depth=MAX_DEPTH + 1), "max_depth"),
        (pb.DraftParams(n_max=MAX_SUFFIX + 1), "n_max"),
        (pb.DraftParams(n_min=MAX_SUFFIX + 1), "n_min"),
        (pb.DraftParams(n_min=12, n_max=8), "n_max"),
    ],
)
def test_params_out_of_range_name_the_field(params, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        wire.config_from_message(params)


@pytest.mark.parametrize(
    "tokens, message",
    [
        ([], "context is empty"),
        (list(range(65)), "context has 65 tokens, more than this server's limit of 64"),
        ([1, 2, 100], r"context\[2\] = 100 is outside the vocabulary \[0, 100\)"),
    ],
)
def test_bad_context_names_the_field(tokens, message):
    with pytest.raises(ValueError, match=message):
        wire.context_from_message(pb.Context(tokens=tokens), vocab_size=100, max_tokens=64)


def test_batch_request_names_the_bad_context():
    request = pb.DraftBatchRequest(contexts=[pb.Context(tokens=[1]), pb.Context()])
    with pytest.raises(ValueError, match=r"contexts\[1\] is empty"):
        wire.parse_draft_batch_request(request, vocab_size=100, max_tokens=64, max_contexts=8)


def test_batch_request_over_the_context_limit_names_it():
    request = pb.DraftBatchRequest(contexts=[pb.Context(tokens=[1])] * 9)
    with pytest.raises(ValueError, match=r"contexts has 9 entries, more than this server's limit of 8 \(--max-batch"):
        wire.parse_draft_batch_request(request, vocab_size=100, max_tokens=64, max_contexts=8)


def one_by_one(messages, vocab_size, max_tokens):
    """What a batch parse must equal: each context checked alone, the first bad one raising."""
    return [wire.context_from_message(m, vocab_size, max_tokens, f"contexts[{i}]") for i, m in enumerate(messages)]


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.lists(st.integers(0, 12), max_size=6), max_size=12))
def test_a_batch_parses_as_its_contexts_do_one_by_one(token_lists):
    """Ids up to 12 of a vocabulary of 10, up to 6 tokens of at most 5, chunks of 3: whatever
    is first wrong (empty, too long, out of the vocabulary) fails with the same message."""
    messages = [pb.Context(tokens=tokens) for tokens in token_lists]
    try:
        expected = [c.tolist() for c in one_by_one(messages, vocab_size=10, max_tokens=5)]
    except ValueError as exc:
        with pytest.raises(ValueError) as err:
            wire.contexts_from_messages(messages, vocab_size=10, max_tokens=5, chunk=3)
        assert str(err.value) == str(exc)
    else:
        parsed = wire.contexts_from_messages(messages, vocab_size=10, max_tokens=5, chunk=3)
        assert [c.tolist() for c in parsed] == expected and all(c.dtype == np.uint32 for c in parsed)


def test_a_batch_parse_asks_before_each_chunk_whether_to_go_on():
    class Gone(Exception):
        pass

    asked = []

    def stop():
        asked.append(True)
        if len(asked) == 2:
            raise Gone

    messages = [pb.Context(tokens=[1])] * 5
    with pytest.raises(Gone):
        wire.contexts_from_messages(messages, vocab_size=10, max_tokens=5, stop=stop, chunk=3)
    assert len(asked) == 2


def test_request_round_trip_sends_only_the_last_n_max_tokens():
    config = DraftConfig(n_max=4, n_min=2)
    request = pb.DraftRequest.FromString(wire.draft_request(np.arange(10), config).SerializeToString())
    context, parsed = wire.parse_draft_request(request, vocab_size=10, max_tokens=64)
    assert context.tolist() == [6, 7, 8, 9] and parsed == config
    batch = wire.draft_batch_request([[1, 2, 3, 4, 5], [7]], config)
    contexts, _ = wire.parse_draft_batch_request(batch, vocab_size=10, max_tokens=64, max_contexts=2)
    assert [c.tolist() for c in contexts] == [[2, 3, 4, 5], [7]]


@pytest.mark.parametrize("context", [[[1, 2]], [1, -3], [0.5, 1.5]], ids=["2-D", "negative", "float"])
def test_client_refuses_contexts_the_wire_cannot_carry(context):
    with pytest.raises(ValueError, match="context"):
        wire.context_to_message(context, n_max=16)


def test_draft_requests_ask_for_outputs_only_when_told():
    config = DraftConfig()
    assert not wire.draft_request([1, 2], config).include_outputs
    assert wire.draft_request([1, 2], config, include_outputs=True).include_outputs
    assert wire.draft_batch_request([[1, 2]], config, include_outputs=True).include_outputs


def test_add_output_request_round_trips_and_refuses_what_the_wire_cannot_carry():
    request = pb.AddOutputRequest.FromString(wire.add_output_request(np.array([7, 0, 49151])).SerializeToString())
    assert wire.output_from_message(request).tolist() == [7, 0, 49151]
    with pytest.raises(ValueError, match=r"tokens\[1\] = -1 is negative"):
        wire.add_output_request([3, -1])
    with pytest.raises(ValueError, match="integer token ids"):
        wire.add_output_request([0.5])


@settings(max_examples=examples(50), deadline=None)
@given(sizes=st.lists(st.integers(0, 3000), max_size=4))
def test_field_sizes_add_up_to_the_reply_size(sizes):
    """The server adds up a batch reply's size tree by tree before serializing it."""
    trees = [pb.DraftTree(tokens=range(n), parents=[-1] * n, counts=[n] * n) for n in sizes]
    assert pb.DraftBatchReply(trees=trees, outputs=trees[:1]).ByteSize() == sum(map(wire.field_size, trees + trees[:1]))


def test_bearer_metadata_carries_only_what_metadata_can():
    assert wire.bearer_metadata("s3cr3t-T0ken") == ("authorization", "Bearer s3cr3t-T0ken")
    for token in ("", "two words", "line\nbreak", "caf\u00e9"):
        with pytest.raises(ValueError, match="printable ASCII"):
            wire.bearer_metadata(token)


def test_info_round_trips():
    shards = (ShardInfo("shard-00000", 10**12 - 5, 4), ShardInfo("shard-00001", 5, 3))
    info = IndexInfo(1, "SmolLM2", "sha256:ab", 49152, 10**12, 7, shards)
    assert wire.info_from_message(pb.InfoReply.FromString(wire.info_to_message(info).SerializeToString())) == info
