// Entry points of the decode-graph ops in the CUDA backend (decode_graph/decode_ops.cu; called from the two
// cases that native/patches add to ggml-cuda.cu).
#pragma once

struct ggml_tensor;
struct ggml_backend_cuda_context;

// True for a node that is one of Ostinato's GPU ops (see decode_graph/decode_ops.h) with supported types, which
// CUDA device `device` can run (a count op only where its table lives).
bool ggml_cuda_ostinato_supports_op(const ggml_tensor * op, int device);
// Launches the node's kernel on the context's stream; false if the node is not an Ostinato op.
bool ggml_cuda_ostinato_forward(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
// Called after the last node of each graph the context computes (one per split of the scheduler),
// before a CUDA graph capture of it ends: the context's stream waits for every decode prefetch chain
// still open on its device. A chain forked in one split whose next layer's route op is in a later
// split (an architecture with an op the CUDA backend lacks between them) would otherwise leave work
// unjoined in the capture, which CUDA refuses (cudaErrorStreamCaptureUnjoined).
void ggml_cuda_ostinato_graph_end(ggml_backend_cuda_context & ctx);
