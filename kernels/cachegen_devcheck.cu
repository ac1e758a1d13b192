// Device self-check of kernels/cachegen_stream.h under nvcc (the header is
// included unchanged): 1) frequency tables for 141,888 (nsym, mean, sigma, P)
// combinations, 2) float conversions, quantization and dequantization on 4M
// values, GPU vs host, bit for bit; 3) a naive one-thread-per-layer GPU decode
// of a chunk encoded by the CPU coder, compared with the CPU decoder's output.
// Not a product decoder: the CUDA coder is a later issue; this proves the
// shared header decides the same bytes on both sides.
//
//   python kernels/devcheck_inputs.py /tmp/cg_dev        # bf16 chunk + CPU decode
//   nvcc -O2 -std=c++14 -arch=sm_90 -Ikernels -o /tmp/cg_dev/check kernels/cachegen_devcheck.cu
//   /tmp/cg_dev/check /tmp/cg_dev/chunk.bin /tmp/cg_dev/decoded.raw
//
// Measured on an H100 (2026-11-22): all three parts identical (DEVCHECK OK).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include "cachegen_stream.h"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s @%d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

struct Combo { int nsym, mq, sq, P; };

__host__ __device__ uint64_t cum_hash(const Combo &c) {
    uint16_t cum[256];
    cg_build_cum(c.nsym, (uint32_t)c.mq, (uint32_t)c.sq, c.P, cum);
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i <= c.nsym; i++) { h ^= cum[i]; h *= 1099511628211ull; }
    return h;
}
__global__ void k_cum(const Combo *c, uint64_t *h, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) h[i] = cum_hash(c[i]);
}
__host__ __device__ void conv(uint32_t bits, float factor, int M, uint32_t *out) {
    float f = cg_f32_from_bits(bits);
    out[0] = cg_f32_to_bf16(f);
    out[1] = (cg_bits_from_f32(f) & 0x7FFFFFFFu) < 0x477FE000u ? cg_f32_to_f16(f) : 0u;
    out[2] = cg_bits_from_f32(cg_bf16_to_f32((uint16_t)bits));
    out[3] = ((bits & 0x7C00u) != 0x7C00u) ? cg_bits_from_f32(cg_f16_to_f32((uint16_t)bits)) : 0u;
    out[4] = (uint32_t)cg_quantize(f, 1.0f, factor, M);
    out[7] = (uint32_t)cg_quantize(f, cg_quant_prescale(f < 0 ? -f : f), cg_quant_factor(M, f < 0 ? -f : f), M);
    out[5] = cg_bits_from_f32(cg_dequant(cg_dequant_unit((int)(bits % (2u * M + 1u)), M), f));
    out[6] = cg_bits_from_f32(cg_quant_factor(M, f < 0 ? -f : f));
}
__global__ void k_conv(const uint32_t *bits, const float *fac, const int *M, uint32_t *out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) conv(bits[i], fac[i], M[i], out + 8 * (size_t)i);
}

// naive decoder: thread = coded layer (bf16 output), cum scratch in global memory
__global__ void k_decode(const uint8_t *p, const uint32_t *offs, const uint32_t *lens, const uint8_t *Ms,
                         int T, int C, int P, int N, uint16_t *cumscratch, uint16_t *out, int *status) {
    int l = blockIdx.x * blockDim.x + threadIdx.x;
    if (l >= gridDim.x * blockDim.x) return;
    const uint8_t *sec = p + offs[l];
    int M = Ms[l], nsym = 2 * M + 1;
    cg_bitreader br = {sec, (uint64_t)lens[l] * 8u, 0, 0};
    // scales (bf16: w = 16)
    uint32_t base = cg_br_bits(&br, 16); int k = (int)cg_br_bits(&br, CG_W_K);
    uint16_t scales[4096];
    for (int t = 0; t < T; t++) scales[t] = (uint16_t)cg_rice_get(&br, base, k, 16);
    uint32_t mb = cg_br_bits(&br, CG_W_MU); int km = (int)cg_br_bits(&br, CG_W_K);
    uint32_t mq[1024], sq[1024];
    for (int c = 0; c < C; c++) mq[c] = cg_rice_get(&br, mb, km, CG_W_MU);
    uint32_t sb = cg_br_bits(&br, CG_W_SIGMA); int ks = (int)cg_br_bits(&br, CG_W_K);
    for (int c = 0; c < C; c++) sq[c] = cg_rice_get(&br, sb, ks, CG_W_SIGMA);
    if (br.err) { status[l] = 1; return; }
    size_t side = (size_t)((br.pos + 31u) / 32u) * 4u;
    uint16_t *cum = cumscratch + (size_t)l * C * 256;
    for (int c = 0; c < C; c++) cg_build_cum(nsym, mq[c], sq[c], P, cum + (size_t)c * 256);
    uint32_t x[64];
    for (int j = 0; j < N; j++) { uint32_t v; memcpy(&v, sec + side + 4 * j, 4); x[j] = v; }
    const uint8_t *wp = sec + side + 4 * N, *wend = sec + lens[l];
    for (int t = 0; t < T; t++) {
        float scale = cg_bf16_to_f32(scales[t]);
        for (int c = 0; c < C; c++) {
            int j = c % N;
            uint32_t slot = cg_dec_slot(x[j], P);
            const uint16_t *cm = cum + (size_t)c * 256;
            int s = 0;
            while (cm[s + 1] <= slot) s++;
            x[j] = cg_dec_advance(x[j], cm[s], (uint32_t)cm[s + 1] - cm[s], P);
            if (cg_dec_needs_word(x[j])) {
                if (wend - wp < 2) { status[l] = 2; return; }
                uint16_t w; memcpy(&w, wp, 2); wp += 2;
                x[j] = cg_dec_push_word(x[j], w);
            }
            out[((size_t)l * T + t) * C + c] = cg_f32_to_bf16(cg_dequant(cg_dequant_unit(s, M), scale));
        }
    }
    for (int j = 0; j < N; j++) if (x[j] != CG_RANS_L) { status[l] = 3; return; }
    status[l] = 0;
}

static std::vector<uint8_t> slurp(const char *path) {
    FILE *f = fopen(path, "rb"); fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
    std::vector<uint8_t> v(n); if (fread(v.data(), 1, n, f) != (size_t)n) exit(2); fclose(f); return v;
}

int main(int argc, char **argv) {
    if (argc != 3) { printf("usage: %s chunk.bin decoded.raw\n", argv[0]); return 2; }
    int fails = 0;
    // 1) tables
    std::vector<Combo> combos;
    int nsyms[] = {3, 7, 15, 31, 63, 255}, Ps[] = {10, 14, 15};
    for (int P : Ps) for (int ns : nsyms) for (int mq = 0; mq <= 4 * (ns - 1); mq++) for (int sq = 0; sq < 32; sq++)
        combos.push_back({ns, mq, sq, P});
    int n = (int)combos.size();
    Combo *dc; uint64_t *dh; CK(cudaMalloc(&dc, n * sizeof(Combo))); CK(cudaMalloc(&dh, n * 8));
    CK(cudaMemcpy(dc, combos.data(), n * sizeof(Combo), cudaMemcpyHostToDevice));
    k_cum<<<(n + 255) / 256, 256>>>(dc, dh, n); CK(cudaDeviceSynchronize());
    std::vector<uint64_t> gh(n); CK(cudaMemcpy(gh.data(), dh, n * 8, cudaMemcpyDeviceToHost));
    int bad = 0; for (int i = 0; i < n; i++) bad += gh[i] != cum_hash(combos[i]);
    printf("tables: %d combos, %d mismatches\n", n, bad); fails += bad;
    // 2) conversions / quantization
    int m = 1 << 22;
    std::vector<uint32_t> bits(m); std::vector<float> fac(m); std::vector<int> Mv(m);
    uint64_t r = 88172645463325252ull;
    for (int i = 0; i < m; i++) {
        r ^= r << 13; r ^= r >> 7; r ^= r << 17;
        uint32_t b = (uint32_t)r;
        if (i % 4 == 0) b = (uint32_t)(r >> 32) & 0x3FFFFFFFu;          // moderate magnitudes
        if (i % 4 == 1) b = ((uint32_t)r & 0x807FFFFFu) | (((uint32_t)(r >> 40) % 60u + 90u) << 23); // near fp16 subnormals
        if (((b >> 23) & 0xFF) == 0xFF) b &= 0xBFFFFFFFu;               // keep finite
        bits[i] = b;
        float x = cg_f32_from_bits(b);
        float mx = (x < 0 ? -x : x) * (1.0f + (float)((r >> 50) % 7) / 8.0f);
        Mv[i] = 1 + (int)((r >> 20) % 127);
        fac[i] = (i % 97 == 0) ? 0.0f : cg_quant_factor(Mv[i], mx);
        if (!(fac[i] < 3.0e38f)) fac[i] = 0.0f;
    }
    uint32_t *db; float *df; int *dM; uint32_t *dout;
    CK(cudaMalloc(&db, m * 4)); CK(cudaMalloc(&df, m * 4)); CK(cudaMalloc(&dM, m * 4)); CK(cudaMalloc(&dout, (size_t)m * 32));
    CK(cudaMemcpy(db, bits.data(), m * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(df, fac.data(), m * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dM, Mv.data(), m * 4, cudaMemcpyHostToDevice));
    k_conv<<<(m + 255) / 256, 256>>>(db, df, dM, dout, m); CK(cudaDeviceSynchronize());
    std::vector<uint32_t> go((size_t)m * 8); CK(cudaMemcpy(go.data(), dout, (size_t)m * 32, cudaMemcpyDeviceToHost));
    int badc[8] = {0};
    for (int i = 0; i < m; i++) { uint32_t h[8]; conv(bits[i], fac[i], Mv[i], h); for (int k = 0; k < 8; k++) badc[k] += h[k] != go[(size_t)i * 8 + k]; }
    printf("conversions: %d values; mismatches bf16 %d f16 %d bf16->f32 %d f16->f32 %d quant %d dequant %d factor %d quant(max) %d\n",
           m, badc[0], badc[1], badc[2], badc[3], badc[4], badc[5], badc[6], badc[7]);
    for (int k = 0; k < 8; k++) fails += badc[k];
    // 3) decode the CPU-encoded chunk on the GPU
    std::vector<uint8_t> pay = slurp(argv[1]), ref = slurp(argv[2]);
    uint32_t L2, T, C; memcpy(&L2, &pay[8], 4); memcpy(&T, &pay[12], 4); memcpy(&C, &pay[16], 4);
    int P = pay[4], N = pay[5];
    size_t dir = 20 + ((L2 + 3) & ~3u);
    std::vector<uint32_t> offs(L2), lens(L2); size_t pos = dir + 4 * L2;
    for (uint32_t l = 0; l < L2; l++) { memcpy(&lens[l], &pay[dir + 4 * l], 4); offs[l] = (uint32_t)pos; pos += lens[l]; }
    uint8_t *dp, *dMs; uint32_t *doffs, *dlens; uint16_t *dcum, *dout16; int *dst;
    CK(cudaMalloc(&dp, pay.size())); CK(cudaMemcpy(dp, pay.data(), pay.size(), cudaMemcpyHostToDevice));
    CK(cudaMalloc(&dMs, L2)); CK(cudaMemcpy(dMs, &pay[20], L2, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&doffs, 4 * L2)); CK(cudaMemcpy(doffs, offs.data(), 4 * L2, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&dlens, 4 * L2)); CK(cudaMemcpy(dlens, lens.data(), 4 * L2, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&dcum, (size_t)L2 * C * 256 * 2)); CK(cudaMalloc(&dout16, (size_t)L2 * T * C * 2)); CK(cudaMalloc(&dst, 4 * L2));
    CK(cudaDeviceSetLimit(cudaLimitStackSize, 32768));
    k_decode<<<L2, 1>>>(dp, doffs, dlens, dMs, (int)T, (int)C, P, N, dcum, dout16, dst); CK(cudaDeviceSynchronize());
    std::vector<uint16_t> o((size_t)L2 * T * C); std::vector<int> stv(L2);
    CK(cudaMemcpy(o.data(), dout16, o.size() * 2, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(stv.data(), dst, 4 * L2, cudaMemcpyDeviceToHost));
    int sbad = 0; for (uint32_t l = 0; l < L2; l++) sbad += stv[l] != 0;
    int obad = memcmp(o.data(), ref.data(), ref.size()) != 0;
    printf("gpu decode of a CPU-encoded chunk [%u,%u,%u] P=%d N=%d: layer errors %d, output %s\n", L2, T, C, P, N, sbad,
           obad ? "DIFFERS" : "identical to the CPU decoder's");
    fails += sbad + obad;
    printf(fails ? "DEVCHECK FAILED\n" : "DEVCHECK OK\n");
    return fails ? 1 : 0;
}
