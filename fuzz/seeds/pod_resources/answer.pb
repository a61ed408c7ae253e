
©
job-0mlž
trainerG
nvidia.com/gpu(GPU-8f6b4c1e-0000-1111-2222-333344445555GPU-aaaa::3J
nvidia.com/mig-1g.18gb0MIG-GPU-8f6b4c1e-0000-1111-2222-333344445555/7/0{
dra*tclaim-aml"gpu.nvidia.comnode-a"gpu-0")gpu.nvidia.comnode-a"gpu-1-mig-9-4-1"other.example.comp"x
8
idledefault'
c"
example.com/gpuGPU-1weird-id