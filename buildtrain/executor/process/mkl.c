/* MKL's vendor check, answered "yes" (loaded by buildtrain/executor/process/mkl.py before torch).
 *
 * MKL honours a conditional-numerical-reproducibility branch (MKL_CBWR=AVX2,STRICT) only when
 * this internal function says the CPU is Intel's; on any other vendor it silently computes on its
 * AUTO branch, whose kernels differ. The MKL inside torch's x86-64 wheels calls it through the
 * dynamic linker, so a definition loaded first, with its symbols global, is the one it calls.
 * Then MKL runs the AVX2 kernels that were asked for, and an AMD CPU computes an Intel CPU's
 * bits (measured: presets/tiny.toml trained to the same weights on a Xeon and an EPYC).
 * Whether MKL really took the asked branch is checked after torch loads, not assumed. */
int mkl_serv_intel_cpu_true(void) { return 1; }
