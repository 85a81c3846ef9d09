// Entry points of the decode-graph ops in the CUDA backend (ostinato_ops.cu; called from the two
// cases that native/patches add to ggml-cuda.cu).
#pragma once

struct ggml_tensor;
struct ggml_backend_cuda_context;

// True for a node that is one of Ostinato's GPU ops (see ostinato_ops.h) with supported types, which
// CUDA device `device` can run (a count op only where its table lives).
bool ggml_cuda_ostinato_supports_op(const ggml_tensor * op, int device);
// Launches the node's kernel on the context's stream; false if the node is not an Ostinato op.
bool ggml_cuda_ostinato_forward(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
