// Reuse of the out-of-place CPU op's gradient buffers.
//
// Why: the gradient of a large loss is one N×C buffer per step (16 MB at 4096 × 1000 fp32, 131 MB at 1024 × 32000).
// glibc serves a request of that size from a fresh mmap, or from heap pages it has trimmed back to the OS since the
// previous buffer was freed, so every step page-faults its whole gradient in again: one minor fault per 4 KiB page,
// 32000 per step at 1024 × 32000 fp32, which can take longer than the step's own work (docs/performance.md).
// This cache keeps the last freed buffers (at most kMaxBlocks, each at least kMinBytes) and hands one back for a
// request of the same byte size, as PyTorch's CUDA caching allocator does for every GPU tensor.
// Memory: at most kMaxBlocks buffers stay reserved between steps (the buffer a training step needs anyway);
// `torch.ops.calibkernels.release_cpu_gradient_cache()` frees them, and CALIBKERNELS_CPU_GRAD_CACHE=0 turns the
// cache off. While a gradient tensor lives, its bytes are reported to the profiler's memory records like any CPU
// allocation, so memory profiles (and bench/harness.py's peak-memory column) still count it.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/accumulate.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

namespace calibkernels {

class GradientBufferCache {
 public:
  static constexpr size_t kMaxBlocks = 2;
  static constexpr size_t kMinBytes = size_t(1) << 20;  // smaller blocks come back from glibc without faults

  static GradientBufferCache& instance() {
    static auto* cache = new GradientBufferCache();  // never destroyed: tensors may outlive static destruction
    return *cache;
  }

  // A contiguous CPU tensor of `sizes` and `options`, from the cache when a freed buffer of that byte size is kept.
  at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
    const size_t nbytes = static_cast<size_t>(c10::multiply_integers(sizes)) * options.dtype().itemsize();
    if (!enabled_ || nbytes < kMinBytes) return at::empty(sizes, options);
    void* block = take(nbytes);
    if (block == nullptr) block = c10::alloc_cpu(nbytes);
    report(block, static_cast<int64_t>(nbytes));
    return at::from_blob(
        block, sizes, [nbytes](void* data) { GradientBufferCache::instance().give_back(data, nbytes); }, options);
  }

  // Frees every kept buffer; returns the bytes freed.
  int64_t release() {
    std::vector<std::pair<size_t, void*>> blocks;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks.swap(free_);
    }
    int64_t bytes = 0;
    for (auto& [size, block] : blocks) {
      c10::free_cpu(block);
      bytes += static_cast<int64_t>(size);
    }
    return bytes;
  }

 private:
  GradientBufferCache() {
    const char* flag = std::getenv("CALIBKERNELS_CPU_GRAD_CACHE");
    enabled_ = flag == nullptr || std::strcmp(flag, "0") != 0;
  }

  void* take(size_t nbytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->first == nbytes) {
        void* block = it->second;
        free_.erase(it);
        return block;
      }
    }
    return nullptr;
  }

  void give_back(void* block, size_t nbytes) {
    report(block, -static_cast<int64_t>(nbytes));
    void* evicted = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (free_.size() == kMaxBlocks) {  // keep the most recently freed
        evicted = free_.front().second;
        free_.erase(free_.begin());
      }
      free_.emplace_back(nbytes, block);
    }
    if (evicted != nullptr) c10::free_cpu(evicted);
  }

  static void report(void* block, int64_t delta) {
    // what the default CPU allocator reports for each allocation and free (the running totals are not tracked here)
    if (c10::memoryProfilingEnabled()) {
      c10::reportMemoryUsageToProfiler(block, delta, 0, 0, c10::Device(c10::DeviceType::CPU));
    }
  }

  std::mutex mutex_;
  std::vector<std::pair<size_t, void*>> free_;
  bool enabled_ = true;
};

}  // namespace calibkernels
