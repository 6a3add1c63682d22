// AMX (Intel's tile matrix unit) for the cpu kernels built for a CPU with amx_tile and amx_bf16 (-march=native there):
// the process's permission to use the tile state and the tile configuration. GRAPHINFER_AMX is defined where the
// compiler targets AMX; the kernels keep their AVX-512 paths for everything else.
#pragma once

#if defined(CPU_CAPABILITY_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define GRAPHINFER_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace cpu_amx {

// Linux hands the tile state only to a process that asks for it (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction faults. Asked once; false: the AVX-512 paths run.
inline bool ready() {
  static const bool ok = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// The 64-byte operand of ldtilecfg (palette 1): rows and bytes per row of each of the 8 tiles. Tiles are per thread
// and oneDNN's kernels on the same threads configure their own, so a kernel loads this before its tile work and
// releases the tiles after it.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void set(int tile, int nrows, int bytes) {
    rows[tile] = static_cast<uint8_t>(nrows);
    colsb[tile] = static_cast<uint16_t>(bytes);
  }
  void load() const { _tile_loadconfig(this); }
};

}  // namespace cpu_amx
#endif
