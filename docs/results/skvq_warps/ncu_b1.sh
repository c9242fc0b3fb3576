# Session 19 (issue 26): Nsight Compute on the Gluon SKVQ kernel at batch 1 (InternVL heads, n32768, K2/V1.5 g64 FP8):
# the new defaults (2 warps, L2 prefetch 1) and the kernel before (4 warps, no prefetch), launches 0-5 in order
# (skvq_profile prints each layout's first timed launch).
export MMKV_CACHE_DIR=$PWD/wip_lead/mmkvcache HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
timeout 240 ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
  --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis -k regex:_skvq_kernel \
  python3 -m eval.bench.skvq_profile --batch 1 --tokens 32768 --warm 2 --calls 1 \
  --layouts "skvq-K2V1.5-g64-var-fp8,skvq-K2V1.5-g64-var-fp8:MMKV_SKVQ_WARPS=4;MMKV_SKVQ_PREFETCH=0" > $OUT/ncu_b1.txt 2>&1
grep -E "first timed|_skvq_kernel|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Block Size|Grid Size|L2 Hit|Waves Per SM" $OUT/ncu_b1.txt | head -120
