"""Packing layouts, checked bit by bit against hand-computed bytes and words."""

import torch

import qtransform as qt


def test_4bit_element_2k_is_the_low_nibble():
    c = torch.tensor([[0x1, 0x2, 0x3, 0xF, 0x7]], dtype=torch.uint8)
    assert qt.pack(c, 4).tolist() == [[0x21, 0xF3, 0x07]]


def test_6bit_codes_fill_three_bytes_per_four_codes():
    c = torch.tensor([[0b000001, 0b000010, 0b000011, 0b111111]], dtype=torch.uint8)
    # stream (LSB first): 000001 | 000010 | 000011 | 111111 -> 0x81, 0x30, 0xFC
    assert qt.pack(c, 6).tolist() == [[0x81, 0x30, 0xFC]]


def test_3bit_and_1bit_streams():
    assert qt.pack(torch.tensor([[1, 0, 1, 1, 0, 0, 0, 1, 1]], dtype=torch.uint8), 1).tolist() == [[0x8D, 0x01]]
    assert qt.pack(torch.tensor([[7, 1, 2]], dtype=torch.uint8), 3).tolist() == [[0b10001111, 0b0]]


def test_int32_awq_order():
    c = torch.arange(8, dtype=torch.uint8).reshape(1, 8)
    word = qt.pack(c, 4, container=torch.int32, order="awq")
    # nibble i holds code [0, 2, 4, 6, 1, 3, 5, 7][i]
    assert word.item() == 0x75316420
    seq = qt.pack(c, 4, container=torch.int32)
    assert seq.item() == 0x76543210


def test_int32_words_are_signed_two_complement():
    c = torch.full((1, 8), 15, dtype=torch.uint8)
    assert qt.pack(c, 4, container=torch.int32).item() == -1


def test_signed_int4_codes_are_stored_as_two_complement_nibbles():
    x = torch.tensor([[-8.0, 7.0]])
    spec = qt.QuantSpec(format="int4", symmetric_range="full")
    q = qt.quantize(x, qt.QParams(scale=torch.ones(1, 1), spec=spec))
    assert q.codes.tolist() == [[0x78]]
    assert qt.unpacked_codes(q).tolist() == [[-8, 7]]
