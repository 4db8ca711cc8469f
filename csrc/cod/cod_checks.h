// Argument checks of the cod_sample op, shared by the CPU and CUDA back ends so both reject
// the same inputs with the same ValueError / TypeError (TORCH_CHECK_VALUE / TORCH_CHECK_TYPE).
// The per-element check (document ids >= -1) is back-end specific: the CPU op loops over the
// ids, the CUDA op reduces them on the device and reads the result with its one host sync.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

#include "cod/cod_common.h"

namespace peagle::cod {

inline void check_cod_inputs(const at::Tensor& document_ids, const at::Tensor& loss_mask, int64_t num_depths, double r,
                             double r_min, int64_t max_anchors) {
  TORCH_CHECK_TYPE(document_ids.scalar_type() == at::kInt, "cod_sample: document_ids must be int32, got ",
                   document_ids.scalar_type());
  TORCH_CHECK_TYPE(loss_mask.scalar_type() == at::kBool, "cod_sample: loss_mask must be bool, got ",
                   loss_mask.scalar_type());
  TORCH_CHECK_VALUE(document_ids.dim() == 1, "cod_sample: document_ids must be 1-D [N], got shape ",
                    document_ids.sizes());
  TORCH_CHECK_VALUE(loss_mask.dim() == 1 && loss_mask.size(0) == document_ids.size(0),
                    "cod_sample: loss_mask must have shape [N] = ", document_ids.sizes(), ", got ", loss_mask.sizes());
  TORCH_CHECK_VALUE(document_ids.is_contiguous() && loss_mask.is_contiguous(),
                    "cod_sample: document_ids and loss_mask must be contiguous");
  TORCH_CHECK_VALUE(document_ids.device() == loss_mask.device(),
                    "cod_sample: document_ids and loss_mask must be on the same device, got document_ids on ",
                    document_ids.device(), " and loss_mask on ", loss_mask.device());
  TORCH_CHECK_VALUE(document_ids.size(0) < (int64_t(1) << 31) - 1, "cod_sample: N must fit in int32");
  TORCH_CHECK_VALUE(num_depths >= 1 && num_depths <= kMaxDepths, "cod_sample: num_depths must be in [1, ", kMaxDepths,
                    "], got ", num_depths);
  TORCH_CHECK_VALUE(r > 0.0 && r <= 1.0, "cod_sample: down_sample_ratio must be in (0, 1], got ", r);
  TORCH_CHECK_VALUE(r_min >= 0.0 && r_min <= 1.0, "cod_sample: down_sample_ratio_min must be in [0, 1], got ", r_min);
  TORCH_CHECK_VALUE(max_anchors >= -1, "cod_sample: max_anchors must be >= 0 (or -1 for none), got ", max_anchors);
}

}  // namespace peagle::cod
