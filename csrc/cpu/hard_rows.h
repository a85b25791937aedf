// The rows of a call with class-index targets and no soft target (process_row), with or without the drop-in options,
// included by uncertainty_weighted_ce_kernel.h inside its per-ISA namespace, after option_rows.h.
//
// The options ride on process_row's own sweeps (the maths of option_rows.h, for t = e_y):
//   * class weights: CE^w = w_y CE and u is the unweighted row's, so a row's loss and gradient are scaled by w_y;
//   * z-loss: s · lse² joins the row outside both weights; its gradient 2 s lse p_k is a multiple of p_k, so it is
//     folded into the row's α (and the target column's fix-up), with lse from the row's reference and normaliser;
//   * soft-capping: the row is capped into a per-thread scratch row z' = c tanh(z / c) (as 16-bit rows are widened),
//     process_row runs on z' with its gradient into a second scratch row, and the cap's chain rule
//     dL/dz_k = dL/dz'_k (1 - (z'_k / c)²) is applied as that row is written out (z' still in L1/L2). In place is
//     fine: z was copied before the gradient overwrites it.
// Which of these a call computes is chosen once per call (HardOptions): the plain op's row loop has none of them.
#pragma once

// The drop-in options a hard row loop computes: none (the plain op), the options without soft-capping, or with it.
enum class HardOptions { None, Uncapped, Capped };

// The per-call values of the hard rows.
template <typename scalar_t, typename acc_t>
struct HardRowCall {
  const scalar_t* logits;
  scalar_t* grads;  // null: no gradient
  int64_t classes, z_stride, grad_stride, ignore_index;
  const int64_t* targets;
  const acc_t* gammas;   // null: spec.gamma
  const acc_t* weights;  // external weights, null: 1
  RowSpec<acc_t> spec;
  double norm;            // gBS's q as given (the sweeps' form: PowQ)
  acc_t scale;            // the gradient's factor of u · CE (1 / D for "mean")
  const acc_t* factors;   // class weights, null: none
  acc_t z_loss_scale;     // s
  acc_t z_grad_scale;     // 2 s (/ count for "mean")
  acc_t* z_loss;          // (N,) the rows' s · lse², null: no z-loss
  acc_t softcap;          // c (HardOptions::Capped)
  bool stream;            // streaming stores for the gradient (use_streaming_stores)
  RowLoss<acc_t>* parts;  // (N,)
  float* confidence;      // return_stats, null: not asked for
  int64_t* prediction;
};

// A 64-byte aligned scratch row of `count` elements inside `storage` (0: none).
template <typename T>
T* aligned_row(std::vector<T>& storage, int64_t count) {
  if (count == 0) return nullptr;
  storage.resize(count + 64 / sizeof(T));
  const auto misalign = reinterpret_cast<uintptr_t>(storage.data()) % 64;
  return storage.data() + (misalign == 0 ? 0 : (64 - misalign) / sizeof(T));
}

// out_k = c tanh(z_k / c) (out may be z), the AVX-512 form for float rows where chosen.
template <typename T, bool kAvx512>
void cap_row(const T* z, T* out, int64_t C, T cap) {
#if CALIBKERNELS_HAVE_AVX512_SWEEPS
  if constexpr (kAvx512 && std::is_same_v<T, float>) {
    avx512::soft_cap_row(z, out, C, cap);
    return;
  }
#endif
  options::soft_cap_row(z, out, C, cap);
}

// out_k = g_k (1 - (z'_k / c)²) (out may be g).
template <typename T>
void cap_gradient_row(const T* g, const T* capped, T* out, int64_t C, T inv_cap) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec one(T(1)), inv(inv_cap);
  auto step = [&](int64_t k, int64_t count) {
    const Vec ratio = Vec::loadu(capped + k, count) * inv;
    (Vec::loadu(g + k, count) * (one - ratio * ratio)).store(out + k, count);
  };
  int64_t k = 0;
  for (; k + W <= C; k += W) step(k, W);
  if (k < C) step(k, C - k);
}

// A capped row (HardOptions::Capped): z' into `capped`, process_row on it with the gradient into `gradient`, then the
// cap's chain rule into grad_row (streamed where `stream`; widened rows are narrowed from `gradient`).
template <typename scalar_t, typename T, PowQ kPow, bool kAvx512>
RowLoss<T> capped_hard_row(const scalar_t* z_row, scalar_t* grad_row, int64_t C, int64_t y, const RowSpec<T>& spec,
                           T gamma, T ext, T scale, T cap, T* capped, T* gradient, bool stream,
                           RowStatsWriter<T>& stats, ZLossTerm<T> z_loss) {
  constexpr bool kSame = std::is_same_v<scalar_t, T>;
  if constexpr (kSame) {
    cap_row<T, kAvx512>(z_row, capped, C, cap);
  } else {
    at::vec::convert(z_row, capped, C);
    cap_row<T, kAvx512>(capped, capped, C, cap);
  }
  stats.take_top_label(capped, C);
  // `gradient` never aliases `capped`, so process_row stores its exponentials there and needs no exponential row
  const RowLoss<T> parts =
      process_row<T, kPow, false, kAvx512, true>(capped, grad_row ? gradient : nullptr, C, y, spec, gamma, ext, scale,
                                                 0, nullptr, false, stats.normaliser(), z_loss);
  if (grad_row == nullptr) return parts;
  const T inv_cap = T(1) / cap;
#if CALIBKERNELS_HAVE_AVX512_SWEEPS
  if constexpr (kAvx512 && std::is_same_v<T, float>) {
    if constexpr (kSame) {
      if (stream) {
        avx512::cap_gradient_sweep<true>(gradient, capped, grad_row, C, inv_cap);
      } else {
        avx512::cap_gradient_sweep<false>(gradient, capped, grad_row, C, inv_cap);
      }
    } else {
      avx512::cap_gradient_sweep<false>(gradient, capped, gradient, C, inv_cap);
      at::vec::convert(gradient, grad_row, C);
    }
    return parts;
  }
#endif
  if constexpr (kSame) {
    cap_gradient_row(gradient, capped, grad_row, C, inv_cap);
  } else {
    cap_gradient_row(gradient, capped, gradient, C, inv_cap);
    at::vec::convert(gradient, grad_row, C);
  }
  return parts;
}

// The rows [begin, end) of a hard call: each row's loss parts to call.parts (finished into loss_ptr), its gradient to
// call.grads. kOptions: the drop-in options (the call's by value, so that its fields are locals of the chunk: read
// through a reference they were reloaded for every row, since a row's stores may alias them).
template <typename scalar_t, typename acc_t, PowQ kPow, bool kDual, bool kAvx512, HardOptions kOptions>
void hard_row_chunk(const HardRowCall<scalar_t, acc_t> call, acc_t* loss_ptr, int64_t begin, int64_t end) {
  constexpr bool kWiden = !std::is_same_v<scalar_t, acc_t>;
  constexpr bool kCapped = kOptions == HardOptions::Capped;
  constexpr bool kAnyOption = kOptions != HardOptions::None;
  const FlushDenormalResults flush_denormals;
  const int64_t classes = call.classes, ignore_index = call.ignore_index, zs = call.z_stride, gs = call.grad_stride;
  const scalar_t* const logits = call.logits;
  scalar_t* const grads = call.grads;
  const acc_t row_scale = call.scale;
  const bool row_stream = call.stream;
  // capped rows: z' and its gradient; the others: the widened row, and the exponentials of rows whose gradient row
  // aliases the logits row (in place, widened) or is streamed
  std::vector<acc_t> scratch_storage, exp_storage;
  acc_t* const scratch = aligned_row(scratch_storage, kWiden || kCapped ? classes : 0);
  const bool aliased = kWiden || static_cast<const void*>(grads) == static_cast<const void*>(logits);
  const bool need_exp_row = grads != nullptr && (kCapped || row_stream || aliased);
  acc_t* const exp_ptr = aligned_row(exp_storage, need_exp_row ? classes : 0);
  RowLoss<acc_t>* const parts = call.parts;
  RowStatsWriter<acc_t> stats(call.confidence, call.prediction);
  for (int64_t i = begin; i < end; ++i) {
    scalar_t* const grad_row = grads ? grads + i * gs : nullptr;
    const int64_t y = call.targets[i];
    if (y == ignore_index) {
      parts[i] = {acc_t(1), acc_t(0), acc_t(0)};
      if constexpr (kAnyOption) {
        if (call.z_loss != nullptr) call.z_loss[i] = acc_t(0);
      }
      if (grad_row) std::fill(grad_row, grad_row + classes, scalar_t(0));
      stats.write_ignored(i);
      continue;
    }
    const scalar_t* const z_row = logits + i * zs;
    const acc_t gamma = call.gammas ? call.gammas[i] : call.spec.gamma;
    const acc_t ext = call.weights ? call.weights[i] : acc_t(1);
    const acc_t factor = kAnyOption && call.factors != nullptr ? call.factors[y] : acc_t(1);
    const acc_t scale_of_row = kAnyOption ? row_scale * factor : row_scale;
    const ZLossTerm<acc_t> z_loss{call.z_loss_scale, call.z_grad_scale,
                                  kAnyOption && call.z_loss != nullptr ? call.z_loss + i : nullptr};
    if constexpr (kCapped) {
      parts[i] = capped_hard_row<scalar_t, acc_t, kPow, kAvx512>(z_row, grad_row, classes, y, call.spec, gamma, ext,
                                                                 scale_of_row, call.softcap, scratch, exp_ptr,
                                                                 row_stream, stats, z_loss);
    } else if constexpr (kWiden) {
      at::vec::convert(z_row, scratch, classes);
      stats.take_top_label(scratch, classes);
      parts[i] = process_row<acc_t, kPow, kDual, kAvx512, kAnyOption>(scratch, grad_row ? scratch : nullptr, classes, y,
                                                                      call.spec, gamma, ext, scale_of_row, 0, exp_ptr,
                                                                      false, stats.normaliser(), z_loss);
      if (grad_row) at::vec::convert(scratch, grad_row, classes);
    } else {
      // as in launch_soft_rows: the top label after the row pass unless that pass overwrites the row
      const bool in_place = static_cast<const void*>(grad_row) == static_cast<const void*>(z_row);
      if (in_place) stats.take_top_label(z_row, classes);
      parts[i] = process_row<acc_t, kPow, kDual, kAvx512, kAnyOption>(
          z_row, grad_row, classes, y, call.spec, gamma, ext, scale_of_row,
          kPrefetchBytes / static_cast<int64_t>(sizeof(acc_t)), exp_ptr, row_stream, stats.normaliser(), z_loss);
      if (!in_place) stats.take_top_label(z_row, classes);
    }
    if constexpr (kAnyOption) parts[i].weight *= factor;
    stats.write(i);
  }
#if CALIBKERNELS_HAVE_AVX512_SWEEPS
  // streaming stores are weakly ordered: make them visible before the op returns the gradient to other threads
  if (row_stream) avx512::stream_fence();
#endif
  finish_row_losses(parts, loss_ptr, begin, end);
}

// The hard rows of a call over a batch (hard_row_chunk, rows in parallel), the row form chosen once: the weight's
// sweeps (PowQ, dual focal), the AVX-512 sweeps, and the options (dual focal takes none: check_options).
template <typename scalar_t, typename acc_t>
void launch_hard_rows(HardRowCall<scalar_t, acc_t> call, int64_t n, HardOptions options, acc_t* loss_ptr, bool avx512) {
  std::vector<RowLoss<acc_t>> row_parts(n);
  call.parts = row_parts.data();
  const bool grad_out_of_place =
      call.grads != nullptr && static_cast<const void*>(call.grads) != static_cast<const void*>(call.logits);
  auto run_rows_with = [&](auto pow_tag, auto dual_tag, auto avx512_tag, auto options_tag) {
    constexpr PowQ kPow = decltype(pow_tag)::value;
    constexpr bool kDual = decltype(dual_tag)::value;
    constexpr bool kAvx512 = decltype(avx512_tag)::value;
    constexpr HardOptions kOptions = decltype(options_tag)::value;
    // only the AVX-512 float sweeps of the one-exponential path have the streaming form; in place the lines are the
    // logits', already in the cache
    constexpr bool kCanStream = kAvx512OneExponentialPath<scalar_t, kPow, kDual, kAvx512>;
    call.stream = kCanStream && grad_out_of_place &&
                  use_streaming_stores(n, call.classes, static_cast<int64_t>(sizeof(scalar_t)));
    at::parallel_for(0, n, row_grain(call.classes), [&](int64_t begin, int64_t end) {
      hard_row_chunk<scalar_t, acc_t, kPow, kDual, kAvx512, kOptions>(call, loss_ptr, begin, end);
    });
  };
  using F = std::false_type;
  using T = std::true_type;
  auto run_rows_on = [&](auto pow_tag, auto dual_tag, auto avx512_tag) {
    if constexpr (!decltype(dual_tag)::value) {
      if (options == HardOptions::Capped) {
        return run_rows_with(pow_tag, dual_tag, avx512_tag, std::integral_constant<HardOptions, HardOptions::Capped>{});
      }
      if (options == HardOptions::Uncapped) {
        return run_rows_with(pow_tag, dual_tag, avx512_tag,
                             std::integral_constant<HardOptions, HardOptions::Uncapped>{});
      }
    }
    run_rows_with(pow_tag, dual_tag, avx512_tag, std::integral_constant<HardOptions, HardOptions::None>{});
  };
  auto run_rows = [&](auto pow_tag, auto dual_tag) {
    if (CALIBKERNELS_HAVE_AVX512_SWEEPS && avx512) {
      run_rows_on(pow_tag, dual_tag, T{});
    } else {
      run_rows_on(pow_tag, dual_tag, F{});
    }
  };
  if (call.spec.weight == Weight::Brier) {
    if (call.norm == 2.0) {
      run_rows(std::integral_constant<PowQ, PowQ::Square>{}, F{});
    } else if (call.norm == 1.0) {
      run_rows(std::integral_constant<PowQ, PowQ::Linear>{}, F{});
    } else {
      run_rows(std::integral_constant<PowQ, PowQ::General>{}, F{});
    }
  } else if (call.spec.weight == Weight::DualFocal) {
    run_rows(std::integral_constant<PowQ, PowQ::None>{}, T{});
  } else {
    run_rows(std::integral_constant<PowQ, PowQ::None>{}, F{});
  }
}
