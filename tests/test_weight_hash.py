"""``--check-weight-hash-across-dp-replicas-interval``'s hashing and comparison in one process; the
check on two data-parallel replicas (identical, and one stepping differently) is in
``test_failsafe_faults.py``, T5's replicas in ``test_megatron_t5.py``."""
import torch

from megatron_integration.weight_hash import differing, parameter_hashes


def test_a_parameter_hash_sees_one_bit_and_names_the_chunk():
    torch.manual_seed(0)
    chunks = [torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False)]
    names, hashes = parameter_hashes(chunks)
    assert names == ["chunk 0: weight", "chunk 0: bias", "chunk 1: weight"]
    assert hashes.shape == (3, 20) and hashes.dtype == torch.uint8
    assert torch.equal(parameter_hashes(chunks)[1], hashes)  # deterministic
    with torch.no_grad():
        w = chunks[1].weight
        w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(1e9))  # one unit in the last place
    again = parameter_hashes(chunks)[1]
    assert torch.equal(again[:2], hashes[:2]) and not torch.equal(again[2], hashes[2])


def test_differing_parameters_name_the_ranks_off_the_majority_or_all_when_there_is_none():
    names = ["chunk 0: a", "chunk 0: b"]
    h = torch.zeros((2, 20), dtype=torch.uint8)
    odd = h.clone()
    odd[1, 0] = 1
    assert differing(names, [h, h, h], [0, 2, 4]) == []
    # The group's first member is the odd one: the majority, not rank order, decides.
    assert differing(names, [odd, h, h], [1, 3, 5]) == ["chunk 0: b on rank 1"]
    assert differing(names, [h, odd, h, h, odd], [0, 1, 2, 3, 4]) == ["chunk 0: b on ranks 1, 4"]
    # Two replicas, or no hash held by more than half: every rank, nobody blamed.
    assert differing(names, [odd, h], [0, 1]) == ["chunk 0: b disagrees between ranks 0, 1 (no majority tells "
                                                  "which is wrong)"]
    assert differing(names, [h, odd, h, odd], [1, 3, 5, 7]) == ["chunk 0: b disagrees between ranks 1, 3, 5, 7 "
                                                                "(no majority tells which is wrong)"]
