"""The formats' own packing and dequantization, vendored (their tools do not install or run here).

Only what the tests need, kept as in the original source (the module's `self.` state turned into
arguments, the 3-bit branches dropped: cpuinfer refuses 3-bit checkpoints); each block keeps its
license. The tests compare our packer (quant_checkpoints.py) bit for bit with these packers, and
our loader's dequantization with these dequantizations.

auto-gptq 0.7.1, auto_gptq/nn_modules/qlinear/qlinear_cuda.py (QuantLinear.pack, and the torch path
of QuantLinear.forward): the GPTQ "v1" checkpoint format (checkpoint_format "gptq").

    MIT License

    Copyright (c) 2023 潘其威(William)

    Permission is hereby granted, free of charge, to any person obtaining a copy
    of this software and associated documentation files (the "Software"), to deal
    in the Software without restriction, including without limitation the rights
    to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
    copies of the Software, and to permit persons to whom the Software is
    furnished to do so, subject to the following conditions:

    The above copyright notice and this permission notice shall be included in all
    copies or substantial portions of the Software.

    THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
    IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
    FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
    AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
    LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
    OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
    SOFTWARE.

GPTQModel 7.7.0, gptqmodel/nn_modules/qlinear/__init__.py (PackableQuantLinear.dequantize_weight and
_dequantize_from_codes): the "gptq_v2" format, whose zero points are stored as they are.

    SPDX-FileCopyrightText: 2024-2025 ModelCloud.ai
    SPDX-FileCopyrightText: 2024-2025 qubitium@modelcloud.ai
    SPDX-License-Identifier: Apache-2.0

AutoAWQ 0.2.9, awq/modules/linear/gemm.py (WQLinear_GEMM.from_linear) and awq/utils/packing_utils.py
(unpack_awq, reverse_awq_order, dequantize_gemm): the AWQ GEMM format.

    MIT License

    Copyright (c) 2023 MIT HAN Lab

    (the same permission notice and disclaimer as auto-gptq's above)
"""

from __future__ import annotations

import numpy as np
import torch

# ---- auto-gptq 0.7.1 (MIT) ------------------------------------------------------------------------------------


def autogptq_pack(W, scales, zeros, g_idx, bits):
    """QuantLinear.pack: W [out, in] float, scales / zeros [out, groups], g_idx [in] -> qweight, qzeros, scales."""
    scales = scales.t().contiguous()
    zeros = zeros.t().contiguous()
    scale_zeros = zeros * scales
    scales = scales.clone().to(dtype=W.dtype)
    infeatures = W.shape[1]

    intweight = []
    for idx in range(infeatures):
        intweight.append(torch.round((W[:, idx] + scale_zeros[g_idx[idx]]) / scales[g_idx[idx]]).to(torch.int)[:, None])
    intweight = torch.cat(intweight, dim=1)
    intweight = intweight.t().contiguous()
    intweight = intweight.numpy().astype(np.uint32)

    i = 0
    row = 0
    qweight = np.zeros((intweight.shape[0] // 32 * bits, intweight.shape[1]), dtype=np.uint32)
    while row < qweight.shape[0]:
        for j in range(i, i + (32 // bits)):
            qweight[row] |= intweight[j] << (bits * (j - i))
        i += 32 // bits
        row += 1

    qweight = qweight.astype(np.int32)
    qweight = torch.from_numpy(qweight)

    zeros -= 1
    zeros = zeros.numpy().astype(np.uint32)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 32 * bits), dtype=np.uint32)
    i = 0
    col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + (32 // bits)):
            qzeros[:, col] |= zeros[:, j] << (bits * (j - i))
        i += 32 // bits
        col += 1

    qzeros = qzeros.astype(np.int32)
    qzeros = torch.from_numpy(qzeros)
    return qweight, qzeros, scales


def autogptq_dequantize(qweight, qzeros, scales, g_idx, bits):
    """The torch path of QuantLinear.forward, up to the weight it multiplies x with: [in, out] float."""
    wf = torch.tensor(list(range(0, 32, bits)), dtype=torch.int32).unsqueeze(0)
    zeros = torch.bitwise_right_shift(
        torch.unsqueeze(qzeros, 2).expand(-1, -1, 32 // bits),
        wf.unsqueeze(0),
    ).to(torch.int16 if bits == 8 else torch.int8)
    zeros = torch.bitwise_and(zeros, (2**bits) - 1)

    zeros = zeros + 1
    zeros = zeros.reshape(scales.shape)

    weight = torch.bitwise_right_shift(
        torch.unsqueeze(qweight, 1).expand(-1, 32 // bits, -1),
        wf.unsqueeze(-1),
    ).to(torch.int16 if bits == 8 else torch.int8)
    weight = torch.bitwise_and(weight, (2**bits) - 1)
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    weights = scales[g_idx.long()] * (weight - zeros[g_idx.long()])
    return weights


# ---- GPTQModel 7.7.0 (Apache-2.0) ------------------------------------------------------------------------------


def gptqmodel_dequantize_v2(qweight, qzeros, scales, g_idx, bits):
    """dequantize_weight (2/4/8 bit, planar off) on a gptq_v2 weight: [in, out] float."""
    pack_factor = 32 // bits
    maxq = 2**bits - 1
    dequant_dtype = torch.int16 if bits == 8 else torch.int8
    wf = torch.tensor(list(range(0, 32, bits)), dtype=torch.int32).unsqueeze(0)
    wf_unsqueeze_zero = wf.unsqueeze(0)
    wf_unsqueeze_neg_one = wf.unsqueeze(-1)
    zeros = torch.bitwise_right_shift(
        torch.unsqueeze(qzeros, 2).expand(-1, -1, pack_factor),
        wf_unsqueeze_zero,  # self.wf.unsqueeze(0),
    ).to(dequant_dtype)
    zeros = torch.bitwise_and(zeros, maxq).reshape(qzeros.shape[0], -1)
    zeros = zeros[:, : scales.shape[1]]

    weight = torch.bitwise_and(
        torch.bitwise_right_shift(
            torch.unsqueeze(qweight, 1).expand(-1, pack_factor, -1),
            wf_unsqueeze_neg_one,  # self.wf.unsqueeze(-1)
        ).to(dequant_dtype),
        maxq,
    )
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    weights = scales[g_idx.long()] * (weight - zeros[g_idx.long()])
    return weights


# ---- AutoAWQ 0.2.9 (MIT) -----------------------------------------------------------------------------------


def autoawq_pack(weight, w_bit, group_size, scales, zeros):
    """WQLinear_GEMM.from_linear: weight [out, in], scales / zeros [groups, out] -> qweight, qzeros, scales."""
    scale_zeros = zeros * scales

    scales = scales.clone().half()

    pack_num = 32 // w_bit

    intweight = []
    for idx in range(weight.shape[1]):
        intweight.append(
            torch.round((weight[:, idx] + scale_zeros[idx // group_size]) / scales[idx // group_size]).to(torch.int)[
                :, None
            ]
        )
    intweight = torch.cat(intweight, dim=1)
    intweight = intweight.t().contiguous()
    intweight = intweight.to(dtype=torch.int32)

    qweight = torch.zeros(
        (intweight.shape[0], intweight.shape[1] // 32 * w_bit),
        dtype=torch.int32,
        device=intweight.device,
    )

    for col in range(intweight.shape[1] // pack_num):
        if w_bit == 4:
            order_map = [0, 2, 4, 6, 1, 3, 5, 7]
        else:
            raise NotImplementedError("Only 4-bit are supported for now.")
        for i in range(pack_num):
            qweight_col = intweight[:, col * pack_num + order_map[i]]
            qweight[:, col] |= qweight_col << (i * w_bit)

    zeros = zeros.to(dtype=torch.int32)

    qzeros = torch.zeros(
        (zeros.shape[0], zeros.shape[1] // 32 * w_bit),
        dtype=torch.int32,
        device=zeros.device,
    )

    for col in range(zeros.shape[1] // pack_num):
        if w_bit == 4:
            order_map = [0, 2, 4, 6, 1, 3, 5, 7]
        else:
            raise NotImplementedError("Only 4-bit are supported for now.")
        for i in range(pack_num):
            qzero_col = zeros[:, col * pack_num + order_map[i]]
            qzeros[:, col] |= qzero_col << (i * w_bit)
    return qweight, qzeros, scales


AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, bits: int):
    shifts = torch.arange(0, 32, bits, device=qzeros.device)

    # unpacking columnwise
    iweights = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(
        torch.int8  # smallest dtype available
    )
    iweights = iweights.view(iweights.shape[0], -1)

    # unpacking columnwise
    if qzeros is not None:
        izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(
            torch.int8  # smallest dtype available
        )
        izeros = izeros.view(izeros.shape[0], -1)
    else:
        izeros = qzeros

    return iweights, izeros


def reverse_awq_order(iweights: torch.Tensor, izeros: torch.Tensor, bits: int):
    reverse_order_tensor = torch.arange(
        iweights.shape[-1],
        dtype=torch.int32,
        device=izeros.device,
    )
    reverse_order_tensor = reverse_order_tensor.view(-1, 32 // bits)
    reverse_order_tensor = reverse_order_tensor[:, AWQ_REVERSE_ORDER]
    reverse_order_tensor = reverse_order_tensor.view(-1)

    if izeros is not None:
        izeros = izeros[:, reverse_order_tensor]
    iweights = iweights[:, reverse_order_tensor]

    return iweights, izeros


def dequantize_gemm(qweight, qzeros, scales, bits, group_size):
    # Unpack the qweight and qzeros tensors
    iweight, izeros = unpack_awq(qweight, qzeros, bits)
    # Reverse the order of the iweight and izeros tensors
    iweight, izeros = reverse_awq_order(iweight, izeros, bits)

    # overflow checks
    iweight = torch.bitwise_and(iweight, (2**bits) - 1)
    izeros = torch.bitwise_and(izeros, (2**bits) - 1)

    # fp16 weights
    scales = scales.repeat_interleave(group_size, dim=0)
    izeros = izeros.repeat_interleave(group_size, dim=0)
    iweight = (iweight - izeros) * scales

    return iweight
