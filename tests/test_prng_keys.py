"""The PRNG-key codec (typed keys as their uint32 key data and back) and the folding of keys
per replica / micro-batch (mirrax/_src/distribute/prng_keys.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mirrax import errors
from mirrax._src.distribute import prng_keys


def test_is_key_is_true_only_for_typed_key_arrays():
    assert prng_keys.is_key(jax.random.key(0))
    assert prng_keys.is_key(jax.random.key(0, impl="rbg"))
    assert not prng_keys.is_key(jax.random.PRNGKey(0))  # legacy: a uint32 array of shape (2,)
    assert not prng_keys.is_key(np.zeros(2, np.uint32))
    assert not prng_keys.is_key(3)
    assert not prng_keys.is_key("key")


def test_a_threefry_key_round_trips_through_its_key_data():
    # threefry2x32's seed s is its two 32-bit words, high then low: 5 -> [0, 5].
    key = jax.random.key(5)
    data, names = prng_keys.to_data(key)
    assert names == ["threefry2x32"]
    assert data.dtype == jnp.uint32
    np.testing.assert_array_equal(data, [0, 5])
    np.testing.assert_array_equal(prng_keys.to_data(jax.random.key(0))[0], [0, 0])
    back = prng_keys.from_data(data, names)
    assert prng_keys.is_key(back) and jax.random.key_impl(back) == "threefry2x32"
    np.testing.assert_array_equal(jax.random.key_data(back), [0, 5])
    # The same key: it draws the same numbers.
    np.testing.assert_array_equal(jax.random.uniform(back, (3,)), jax.random.uniform(key, (3,)))


def test_an_rbg_key_round_trips_through_its_four_words():
    key = jax.random.key(7, impl="rbg")
    data, names = prng_keys.to_data(key)
    assert names == ["rbg"]
    np.testing.assert_array_equal(data, [0, 7, 0, 7])  # rbg seeds both halves as threefry: [0, 7] twice
    back = prng_keys.from_data(data, names)
    assert jax.random.key_impl(back) == "rbg"
    np.testing.assert_array_equal(jax.random.bits(back, (4,)), jax.random.bits(key, (4,)))


def test_a_batch_of_keys_gains_a_last_axis_of_words():
    keys = jax.vmap(jax.random.key)(jnp.arange(3))  # shape (3,)
    data, names = prng_keys.to_data(keys)
    np.testing.assert_array_equal(data, [[0, 0], [0, 1], [0, 2]])  # shape (3,) + (2,)
    assert prng_keys.from_data(data, names).shape == (3,)


def test_a_tree_mixing_keys_and_arrays_converts_only_the_typed_keys():
    tree = {
        "w": jnp.ones(3),
        "key": jax.random.key(7),
        "legacy": jax.random.PRNGKey(3),
        "steps": 3,
        "nested": [jax.random.key(1, impl="rbg"), None],
    }
    data, names = prng_keys.to_data(tree)
    # Leaves in jax.tree.leaves order (sorted dict keys; None is no leaf): key, legacy,
    # nested[0], steps, w.
    assert names == ["threefry2x32", None, "rbg", None, None]
    assert prng_keys.impl_names(tree) == names
    np.testing.assert_array_equal(data["key"], [0, 7])
    np.testing.assert_array_equal(data["nested"][0], [0, 1, 0, 1])
    assert data["legacy"] is tree["legacy"] and data["w"] is tree["w"] and data["steps"] == 3
    assert data["nested"][1] is None
    back = prng_keys.from_data(data, names)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    assert [prng_keys.impl_name(x) for x in jax.tree.leaves(back)] == names
    np.testing.assert_array_equal(jax.random.key_data(back["key"]), [0, 7])
    np.testing.assert_array_equal(back["legacy"], [0, 3])


def test_the_codec_works_on_traced_keys():
    @jax.jit
    def round_trip(key):
        data, names = prng_keys.to_data(key)
        return jax.random.key_data(prng_keys.from_data(data + 1, names))

    np.testing.assert_array_equal(round_trip(jax.random.key(4)), [0 + 1, 4 + 1])


def test_from_data_with_names_for_another_tree_is_refused():
    with pytest.raises(
        errors.InvalidArgumentError,
        match=r"^prng_keys\.from_data: 2 implementation names for a tree of 1 leaf; pass the names "
        r"that to_data \(or impl_names\) gave for this tree\.$",
    ):
        prng_keys.from_data([np.zeros(2, np.uint32)], ["threefry2x32", None])


def test_from_data_of_data_that_is_not_key_data_says_what_the_key_needs():
    with pytest.raises(
        errors.InvalidArgumentTypeError,
        match=r"^prng_keys\.from_data: leaf 0 is not threefry2x32 key data: received ndarray of "
        r"shape \(2,\) and dtype int32; threefry2x32 key data is uint32 of shape \(\.\.\., 2\), as "
        r"jax\.random\.key_data gives it\.$",
    ):
        prng_keys.from_data(np.zeros(2, np.int32), ["threefry2x32"])
    # Threefry's two words are not an rbg key's four.
    with pytest.raises(
        errors.InvalidArgumentTypeError,
        match=r"^prng_keys\.from_data: leaf 1 is not rbg key data: received ndarray of shape "
        r"\(2,\) and dtype uint32; rbg key data is uint32 of shape \(\.\.\., 4\)",
    ):
        prng_keys.from_data([np.ones(1), np.zeros(2, np.uint32)], [None, "rbg"])


class _Holder(nnx.Module):
    def __init__(self, rngs):
        self.rngs = rngs


def test_folded_folds_each_key_once_inside_the_block_and_restores_it():
    rngs = nnx.Rngs(0, dropout=1)
    # Two modules sharing one Rngs: each of its keys is folded once, not once per module.
    nodes = (_Holder(rngs), _Holder(rngs))
    with prng_keys.folded(nodes, 5):
        np.testing.assert_array_equal(
            jax.random.key_data(rngs.default.key[...]),
            jax.random.key_data(jax.random.fold_in(jax.random.key(0), 5)),
        )
        np.testing.assert_array_equal(
            jax.random.key_data(rngs.dropout.key[...]),
            jax.random.key_data(jax.random.fold_in(jax.random.key(1), 5)),
        )
        rngs.dropout()  # a draw inside the block advances the count
    np.testing.assert_array_equal(jax.random.key_data(rngs.default.key[...]), [0, 0])
    np.testing.assert_array_equal(jax.random.key_data(rngs.dropout.key[...]), [0, 1])
    assert int(rngs.dropout.count[...]) == 1 and int(rngs.default.count[...]) == 0


def test_folded_folds_a_legacy_uint32_key_variable():
    holder = _Holder(None)
    holder.seed = nnx.RngKey(jax.random.PRNGKey(3))  # as a Keras SeedGenerator's state
    with prng_keys.folded(holder, 2):
        np.testing.assert_array_equal(holder.seed[...], jax.random.fold_in(jax.random.PRNGKey(3), 2))
    np.testing.assert_array_equal(holder.seed[...], [0, 3])
