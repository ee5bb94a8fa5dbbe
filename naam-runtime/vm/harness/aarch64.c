/*
 * Runs aarch64 code produced by naam-vm's JIT, under qemu-user on a host that is not aarch64
 * (the BlueField-2's Cortex-A72 cores are Armv8.0-A; no aarch64 Rust standard library can be
 * installed on the build machine, so this small freestanding-style C program is the process
 * the code runs in).
 *
 * It only provides what the generated code expects of its process: memory mapped as the host
 * describes it, the helper table, and the slow-path access check. Everything about the
 * machine state comes from naam_vm.h, which naam-vm's build script generates from the Rust
 * definitions (naam_vm::memory::c_header), so the layouts cannot drift apart.
 *
 * Input on stdin (all integers u64 little-endian):
 *   magic "NAAMX002"
 *   code_len, code bytes (padded to 8), entry offset
 *   helper_set (0 = NAAM, 1 = conformance), helper mask (bit i: helper id i installed)
 *   region_count, then per region: len, writable, page offset (host address & 4095),
 *     bytes (padded to 8)                         -- region 0 is the naam_vmctx
 *   fixup_count, then per fixup: region, offset, target region, addend
 *     (stores the address of `target` + addend at `offset` in `region`)
 *   r1 (region, addend; region 2^64-1: addend is r1 itself), r2 (value)
 * (the frame pointer is no input: compiled code finds the stack inside the naam_vmctx)
 *
 * Output on stdout: "r0 <hex>", "map <i> <address> <length>" (hex) for every region, then
 * "region <i> <hex bytes>" for every writable region as the run left it (region 0 carries the
 * fault record, the instruction count and the trace).
 * Exit code 0 when the run happened (even if it faulted), 2 on bad input.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "naam_vm.h"

static void die(const char *why) {
    fprintf(stderr, "naam-aarch64-harness: %s\n", why);
    exit(2);
}

static uint8_t *input;
static size_t input_len, input_pos;

static uint64_t take(void) {
    uint64_t v;
    if (input_pos + 8 > input_len) die("truncated input");
    memcpy(&v, input + input_pos, 8);
    input_pos += 8;
    return v;
}

static const uint8_t *take_bytes(uint64_t len) {
    uint64_t padded = (len + 7) & ~7ULL;
    if (len > input_len || input_pos + padded > input_len) die("truncated bytes");
    const uint8_t *p = input + input_pos;
    input_pos += padded;
    return p;
}

/* --- grants: mirrors naam_vm::memory::GrantSlot --- */

static unsigned size_index(uint64_t size) {
    return (unsigned)__builtin_ctzll(size) & 3;
}

static int allows_small(const naam_grant *g, uint64_t addr, uint64_t size, int write) {
    uint64_t lim = write ? g->write_lim[size_index(size)] : g->read_lim[size_index(size)];
    return addr - g->start < lim;
}

static int allows_range(const naam_vmctx *c, uint64_t addr, uint64_t len, int write) {
    if (len == 0) return 1;
    for (unsigned i = 0; i < NAAM_MAX_GRANTS; i++) {
        const naam_grant *g = &c->grants[i];
        /* The 1-byte limit is zero exactly when the right is missing (or the slot is empty). */
        if ((write ? g->write_lim[0] : g->read_lim[0]) == 0) continue;
        uint64_t off = addr - g->start;
        if (off < g->len && len <= g->len - off) return 1;
    }
    return 0;
}

static void set_fault(naam_vmctx *c, uint64_t kind, uint64_t pc, uint64_t addr, uint64_t len) {
    if (c->fault.kind == 0) {
        c->fault.kind = kind;
        c->fault.pc = pc;
        c->fault.addr = addr;
        c->fault.len = len;
    }
}

static uint64_t check_slow(naam_vmctx *c, uint64_t addr, uint64_t size, uint64_t kind, uint64_t pc) {
    uint64_t site = kind >> NAAM_SITE_SHIFT;
    int probe = (kind & NAAM_ACCESS_PROBE) != 0;
    kind &= ((1ULL << NAAM_SITE_SHIFT) - 1) & ~(uint64_t)NAAM_ACCESS_PROBE;
    int write = kind != NAAM_ACCESS_LOAD;
    for (unsigned i = 0; i < NAAM_MAX_GRANTS; i++)
        if (allows_small(&c->grants[i], addr, size, write)) {
            /* Remembered for the site, as naam_vm::memory::check_slow does. */
            if (site >= 1 && site <= NAAM_SITE_HINTS)
                c->sites[site - 1] = (uint8_t)i;
            return 1;
        }
    /* A probe (inline helper code) only looks: a miss is not a fault. */
    if (probe) return 0;
    set_fault(c, kind == NAAM_ACCESS_LOAD ? NAAM_FAULT_LOAD
                 : kind == NAAM_ACCESS_STORE ? NAAM_FAULT_STORE : NAAM_FAULT_ATOMIC,
              pc, addr, size);
    return 0;
}

/* --- helpers: mirror naam_vm::helpers --- */

typedef uint64_t (*helper_fn)(naam_vmctx *, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t);

static uint64_t h_abort(naam_vmctx *c, uint64_t code, uint64_t b, uint64_t d, uint64_t e, uint64_t f) {
    (void)b; (void)d; (void)e; (void)f;
    set_fault(c, NAAM_FAULT_ABORT, 0, code, 0);
    return NAAM_HELPER_ABORT_R0;
}

static uint64_t h_trace(naam_vmctx *c, uint64_t v, uint64_t b, uint64_t d, uint64_t e, uint64_t f) {
    (void)b; (void)d; (void)e; (void)f;
    if (c->trace_len < NAAM_TRACE_CAP) c->trace[c->trace_len++] = v;
    return 0;
}

static uint64_t h_memcpy(naam_vmctx *c, uint64_t dst, uint64_t src, uint64_t len, uint64_t e, uint64_t f) {
    (void)e; (void)f;
    if (len > NAAM_HELPER_MAX_LEN || !allows_range(c, src, len, 0) || !allows_range(c, dst, len, 1))
        return NAAM_HELPER_ERR_FAULT;
    if (len) memmove((void *)dst, (const void *)src, len);
    return 0;
}

static uint64_t h_memset(naam_vmctx *c, uint64_t dst, uint64_t byte, uint64_t len, uint64_t e, uint64_t f) {
    (void)e; (void)f;
    if (len > NAAM_HELPER_MAX_LEN || !allows_range(c, dst, len, 1)) return NAAM_HELPER_ERR_FAULT;
    if (len) memset((void *)dst, (int)(uint8_t)byte, len);
    return 0;
}

static int readable(naam_vmctx *c, uint64_t addr, uint64_t len) {
    return len <= NAAM_HELPER_MAX_LEN && allows_range(c, addr, len, 0);
}

static uint64_t h_memcmp(naam_vmctx *c, uint64_t a, uint64_t b, uint64_t len, uint64_t e, uint64_t f) {
    (void)e; (void)f;
    if (!readable(c, a, len) || !readable(c, b, len)) return NAAM_HELPER_ERR_FAULT;
    int r = len ? memcmp((const void *)a, (const void *)b, len) : 0;
    return r == 0 ? NAAM_CMP_EQUAL : r < 0 ? NAAM_CMP_LESS : NAAM_CMP_GREATER;
}

static uint64_t mix(uint64_t h, uint64_t w) {
    uint64_t x = (h ^ w) * NAAM_HASH_K;
    return x ^ (x >> 29);
}

static uint64_t h_hash64(naam_vmctx *c, uint64_t ptr, uint64_t len, uint64_t seed, uint64_t e, uint64_t f) {
    (void)e; (void)f;
    if (!readable(c, ptr, len)) return NAAM_HELPER_ERR_FAULT;
    const uint8_t *p = (const uint8_t *)ptr;
    uint64_t h = seed ^ (len * NAAM_HASH_K), i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = mix(h, w);
    }
    if (i < len) {
        uint64_t w = 0;
        memcpy(&w, p + i, len - i);
        h = mix(h, w ^ ((len - i) << 56));
    }
    uint64_t z = h;
    z = (z ^ (z >> 30)) * NAAM_HASH_M1;
    z = (z ^ (z >> 27)) * NAAM_HASH_M2;
    return z ^ (z >> 31);
}

static uint64_t h_unwind(naam_vmctx *c, uint64_t v, uint64_t b, uint64_t d, uint64_t e, uint64_t f) {
    (void)c; (void)b; (void)d; (void)e; (void)f;
    return v;
}

/* --- the run --- */

typedef uint64_t (*entry_fn)(naam_vmctx *, uint64_t, uint64_t);

#define MAX_REGIONS 64

static uint8_t *region_addr[MAX_REGIONS];
static uint64_t region_len[MAX_REGIONS], region_writable[MAX_REGIONS];

static void print_hex(const uint8_t *p, uint64_t len) {
    static const char digits[] = "0123456789abcdef";
    for (uint64_t i = 0; i < len; i++) {
        putchar(digits[p[i] >> 4]);
        putchar(digits[p[i] & 15]);
    }
}

int main(void) {
    size_t cap = 1 << 20;
    input = malloc(cap);
    if (!input) die("out of memory");
    for (;;) {
        size_t n = fread(input + input_len, 1, cap - input_len, stdin);
        input_len += n;
        if (n == 0) break;
        if (input_len == cap) {
            cap *= 2;
            input = realloc(input, cap);
            if (!input) die("out of memory");
        }
    }
    if (take() != NAAM_HARNESS_MAGIC) die("bad magic");

    uint64_t code_len = take();
    const uint8_t *code = take_bytes(code_len);
    uint64_t entry = take();
    if (entry >= code_len) die("entry outside the code");
    uint64_t helper_set = take(), helper_mask = take();

    uint64_t nregions = take();
    if (nregions == 0 || nregions > MAX_REGIONS) die("bad region count");
    for (uint64_t i = 0; i < nregions; i++) {
        uint64_t len = take(), writable = take(), page_off = take() & 4095;
        const uint8_t *bytes = take_bytes(len);
        uint8_t *m = mmap(NULL, len + page_off + 4096, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) die("mmap of a region failed");
        region_addr[i] = m + page_off;
        region_len[i] = len;
        region_writable[i] = writable;
        memcpy(region_addr[i], bytes, len);
    }
    if (region_len[0] != sizeof(naam_vmctx)) die("region 0 is not a naam_vmctx");

    uint64_t nfixups = take();
    for (uint64_t i = 0; i < nfixups; i++) {
        uint64_t r = take(), off = take(), target = take(), addend = take();
        if (r >= nregions || target >= nregions || off > region_len[r] || region_len[r] - off < 8)
            die("bad fixup");
        uint64_t v = (uint64_t)region_addr[target] + addend;
        memcpy(region_addr[r] + off, &v, 8);
    }
    uint64_t r1_region = take(), r1_add = take(), r2 = take();
    if (r1_region >= nregions && r1_region != UINT64_MAX) die("bad register location");
    /* r1 region UINT64_MAX: r1 is the absolute value `r1_add` (no memory at all). */
    uint64_t r1 = r1_region == UINT64_MAX ? r1_add : (uint64_t)region_addr[r1_region] + r1_add;

    naam_vmctx *c = (naam_vmctx *)region_addr[0];
    memset(c->helpers, 0, sizeof c->helpers);
    helper_fn naam[] = {0, h_abort, h_trace, h_memcpy, h_memcmp, h_hash64, h_memset};
    for (unsigned id = 0; id < NAAM_HELPER_SLOTS && id < 64; id++) {
        if (!(helper_mask >> id & 1)) continue;
        helper_fn f = 0;
        if (helper_set == 0 && id < sizeof naam / sizeof naam[0]) f = naam[id];
        if (helper_set == 1 && id == NAAM_HELPER_ID_UNWIND) f = h_unwind;
        c->helpers[id] = (uint64_t)f;
    }
    c->check = (uint64_t)check_slow;

    uint8_t *text = mmap(NULL, code_len + 4096, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (text == MAP_FAILED) die("mmap of the code failed");
    memcpy(text, code, code_len);
    if (mprotect(text, code_len + 4096, PROT_READ | PROT_EXEC) != 0) die("mprotect of the code failed");
    __builtin___clear_cache((char *)text, (char *)text + code_len);

    entry_fn run = (entry_fn)(text + entry);
    uint64_t r0 = run(c, r1, r2);

    printf("r0 %llx\n", (unsigned long long)r0);
    for (uint64_t i = 0; i < nregions; i++)
        printf("map %llu %llx %llx\n", (unsigned long long)i,
               (unsigned long long)region_addr[i], (unsigned long long)region_len[i]);
    for (uint64_t i = 0; i < nregions; i++) {
        if (!region_writable[i]) continue;
        printf("region %llu ", (unsigned long long)i);
        print_hex(region_addr[i], region_len[i]);
        putchar('\n');
    }
    return 0;
}
