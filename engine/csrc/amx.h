// AMX-BF16 where the compiler targets it (-march=native on a CPU that has it): BATCHERY_AMX, the tile
// configuration and the OS's grant of the tile state. Used by the AMX linears (amx_linear.cpp) and the
// prefill attention's AMX pass (prefill_attention.cpp).
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define BATCHERY_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out the tile state only on request (once per process); false where the kernel refuses it
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}
#endif
