// A cache of freed CPU tensor blocks for PyTorch, installed as its CPU allocator (rlhf_trl.cpu.install_tensor_cache).
//
// Why: a training step allocates the same activation shapes every step. PyTorch's default CPU allocator hands
// large blocks to glibc, which maps each (>= 32 MB, or >= M_MMAP_THRESHOLD) afresh and unmaps it when freed, so
// the kernel zeroes every activation page again at every step: 15-25 % of a Qwen2.5-0.5B value-model step on the
// CPUs of bench-real (on a VM whose host takes freed pages back, zeroing ran at ~0.5 GB/s: 23 % in
// clear_page_erms). Kept blocks are reused with their pages already in place.
//
// What: requests of at least `min_bytes` are rounded up to a size class (an eighth of their power of two: at most
// 12.5 % more address space, no more resident memory, as the pages past the request are never touched), so a
// tensor that grows a little at a time (the KV cache's torch.cat at every decoding step) reuses one block for many
// steps. Each block is its own anonymous mapping. Freed blocks are kept by size class; a request takes the most
// recently freed block of the smallest kept size that fits and leaves at most `max_unused` of it unused. A request
// no kept block serves is made of the pages of the oldest kept blocks, moved into its address range with mremap
// (no page is zeroed again; a block's unused tail stays kept; at most kMaxPieces mappings per block), fresh pages
// only for what they do not cover; then the oldest kept blocks are freed until live + kept <= the most live bytes
// seen so far + `headroom` (or live when that is a new high): kept blocks never raise the peak of this allocator's
// footprint by more than `headroom` bytes, and one phase's freed blocks become the next phase's tensors whatever
// their sizes (PPO's training activations, the rollout's KV cache and merged weights, the reward model's weights).
// `release` frees the kept blocks. Plain C entry points for ctypes; no Python headers needed.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

struct Cache {
  std::mutex mu;
  std::unordered_map<void*, size_t> live;               // block -> size, every block this allocator handed out
  std::unordered_map<void*, std::vector<size_t>> pieces;  // block -> lengths of the mappings it is made of (>1 only)
  std::map<size_t, std::deque<std::pair<void*, uint64_t>>> free;  // size -> kept blocks, oldest first
  std::map<uint64_t, std::pair<size_t, void*>> lru;     // free tick -> kept block, for eviction oldest first
  size_t cached = 0, min_bytes = 0, headroom = 0;  // bytes
  double max_unused = 0;                                // fraction of a kept block a request may leave unused
  size_t live_bytes = 0, peak_live = 0;                 // bytes of handed-out blocks (>= min_bytes): now, most ever
  uint64_t tick = 0;
  size_t mappings = 0, max_mappings = 0;  // the mappings all blocks are made of; recycling stops near the bound
  uint64_t hits = 0, misses = 0, recycled = 0;  // recycled: bytes of kept blocks' pages moved into misses
  bool enabled = false;
};

Cache& cache() {
  static Cache* c = new Cache();  // never destroyed: tensors may be freed during interpreter shutdown
  return *c;
}

void take(Cache& c, void* p, size_t n) {
  c.live[p] = n;
  c.live_bytes += n;
  c.peak_live = std::max(c.peak_live, c.live_bytes);
}

// A block's memory: its own anonymous mapping (page-aligned; sizes are page multiples), so that its pages can move
// into other blocks (mremap) instead of going back to the kernel. nullptr when the kernel refuses.
void* map_block(size_t n) {
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

void unmap_block(Cache& c, void* p, size_t n) {
  auto it = c.pieces.find(p);
  c.mappings -= it == c.pieces.end() ? 1 : it->second.size();
  if (it != c.pieces.end()) c.pieces.erase(it);
  munmap(p, n);
}

// the lengths of the mappings block p (n bytes) is made of, in address order
std::vector<size_t> pieces_of(Cache& c, void* p, size_t n) {
  auto it = c.pieces.find(p);
  if (it == c.pieces.end()) return {n};
  std::vector<size_t> out = std::move(it->second);
  c.pieces.erase(it);
  return out;
}

void keep(Cache& c, void* p, size_t n, uint64_t t) {
  c.free[n].emplace_back(p, t);
  c.lru.emplace(t, std::make_pair(n, p));
  c.cached += n;
}

// removes kept block (n bytes at p, freed at tick t) from the kept lists
void unkeep(Cache& c, void* p, size_t n, uint64_t t) {
  auto blocks = c.free.find(n);
  auto& dq = blocks->second;
  for (auto it = dq.begin(); it != dq.end(); ++it) {
    if (it->first == p) {
      dq.erase(it);
      break;
    }
  }
  if (dq.empty()) c.free.erase(blocks);
  c.lru.erase(t);
  c.cached -= n;
}

void evict_oldest(Cache& c) {
  auto first = c.lru.begin();
  auto [n, p] = first->second;
  unkeep(c, p, n, first->first);
  unmap_block(c, p, n);
}

// mappings one block may be made of (bounds the process's mapping count; beyond half of vm.max_map_count blocks stay
// one mapping each). 8 left each PPO update on Qwen2.5-0.5B needing ~2.3 GB of fresh (zeroed) pages while as many
// resident kept bytes were freed: kept blocks fall into pieces over time, and 8 of them could not cover a request;
// 64: ~0.6 GB (bench-real's rlhf_trl_fast: kernel CPU time per update 3.3-3.8 -> 1.9-2.1 s, ~4,300 mappings).
constexpr size_t kMaxPieces = 64;

// Fills a fresh n-byte block at p with the pages of the oldest kept blocks (moved, not copied: no page is zeroed
// again); a kept block's unused tail stays kept, with its age. Returns the bytes moved; the rest of p is fresh.
size_t recycle_into(Cache& c, char* p, size_t n, std::vector<size_t>& got) {
  size_t off = 0;
  // near the process's mapping limit (vm.max_map_count) blocks stay one mapping each
  while (off < n && !c.lru.empty() && got.size() < kMaxPieces && c.mappings + 2 * kMaxPieces < c.max_mappings) {
    auto first = c.lru.begin();
    uint64_t t = first->first;
    auto [m, q] = first->second;
    unkeep(c, q, m, t);
    std::vector<size_t> qp = pieces_of(c, q, m);
    c.mappings -= qp.size();
    char* src = static_cast<char*>(q);
    size_t used = 0, i = 0;
    for (; i < qp.size() && off < n && got.size() < kMaxPieces; ++i) {
      size_t len = std::min(qp[i], n - off);
      if (mremap(src + used, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, p + off) == MAP_FAILED) break;
      got.push_back(len);
      off += len;
      used += len;
      if (len < qp[i]) {  // the rest of this mapping stays where it is
        qp[i] -= len;
        break;
      }
    }
    if (used < m) {  // what is left of q is still a kept block, as old as q was
      std::vector<size_t> rest(qp.begin() + i, qp.end());
      void* r = src + used;
      c.mappings += rest.size();
      if (rest.size() > 1) c.pieces[r] = std::move(rest);
      keep(c, r, m - used, t);
      if (i < qp.size() && off < n && got.size() < kMaxPieces) break;  // mremap failed: stop recycling
    }
  }
  c.recycled += off;
  return off;
}

void cached_delete(void* p) {
  if (p == nullptr) return;
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> g(c.mu);
    auto it = c.live.find(p);
    if (it != c.live.end()) {
      size_t n = it->second;
      c.live.erase(it);
      c.live_bytes -= n;
      if (c.enabled) {  // live + kept stays the same: within the budget
        keep(c, p, n, ++c.tick);
      } else {
        unmap_block(c, p, n);
      }
      return;
    }
  }
  c10::free_cpu(p);
}

// n rounded up to a multiple of an eighth of its power of two (>= 4 KB)
size_t size_class(size_t n) {
  size_t step = std::max<size_t>(size_t{1} << (63 - __builtin_clzll(n)) >> 3, 4096);
  return (n + step - 1) / step * step;
}

size_t release_locked(Cache& c) {
  size_t n = c.cached;
  for (auto& kv : c.lru) unmap_block(c, kv.second.second, kv.second.first);
  c.lru.clear();
  c.free.clear();
  c.cached = 0;
  return n;
}

struct CachingCPUAllocator final : at::Allocator {
  at::DataPtr allocate(size_t n) override {
    Cache& c = cache();
    if (n >= c.min_bytes && n > 0) {
      n = size_class(n);
      std::lock_guard<std::mutex> g(c.mu);
      // the smallest kept size that fits, if the request leaves at most max_unused of it unused
      auto it = c.free.lower_bound(n);
      if (it != c.free.end() && static_cast<double>(it->first - n) <= c.max_unused * static_cast<double>(it->first)) {
        size_t m = it->first;
        auto [p, t] = it->second.back();  // the most recently freed block of this size: its pages are warmest
        it->second.pop_back();
        if (it->second.empty()) c.free.erase(it);
        c.lru.erase(t);
        c.cached -= m;
        take(c, p, m);
        ++c.hits;
        return {p, p, &cached_delete, at::Device(at::DeviceType::CPU)};
      }
      ++c.misses;
      // A new block, made of the pages of the oldest kept blocks as far as they go (fresh pages for the rest);
      // then the oldest kept blocks are freed until live + kept + n stays within the most live bytes seen so far +
      // headroom (or live + n when that is a new high).
      void* fresh = map_block(n);
      if (fresh == nullptr) {  // out of memory or of mappings (vm.max_map_count): the kept blocks go first
        release_locked(c);
        fresh = map_block(n);
        if (fresh == nullptr) throw std::bad_alloc();
      }
      char* p = static_cast<char*>(fresh);
      std::vector<size_t> got;
      size_t moved = recycle_into(c, p, n, got);
      if (!got.empty() && moved < n) got.push_back(n - moved);
      c.mappings += std::max<size_t>(got.size(), 1);
      if (got.size() > 1) c.pieces[p] = std::move(got);
      size_t budget = std::max(c.peak_live + c.headroom, c.live_bytes + n);
      while (c.cached > 0 && c.live_bytes + c.cached + n > budget) evict_oldest(c);
      take(c, p, n);
      return {p, p, &cached_delete, at::Device(at::DeviceType::CPU)};
    }
    void* p = c10::alloc_cpu(n);
    return {p, p, &c10::free_cpu, at::Device(at::DeviceType::CPU)};
  }
  // raw_allocate / raw_deallocate (oneDNN's buffers): blocks it does not know go to c10::free_cpu
  at::DeleterFnPtr raw_deleter() const override { return &cached_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CachingCPUAllocator* the_allocator() {
  static CachingCPUAllocator* a = new CachingCPUAllocator();
  return a;
}

}  // namespace

extern "C" {

// Installs the cache as PyTorch's CPU allocator (priority 200; later allocations only). Returns 0.
int rlhf_trl_tensor_cache_install(uint64_t headroom_bytes, uint64_t min_bytes, double max_unused) {
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> g(c.mu);
    c.min_bytes = min_bytes;
    c.headroom = headroom_bytes;
    c.max_unused = max_unused;
    c.enabled = true;
    // half of vm.max_map_count (the kernel's per-process limit; 65530 by default) for the cache's blocks
    size_t limit = 65530;
    if (FILE* f = fopen("/proc/sys/vm/max_map_count", "r")) {
      unsigned long v = 0;
      if (fscanf(f, "%lu", &v) == 1 && v > 0) limit = v;
      fclose(f);
    }
    c.max_mappings = limit / 2;
  }
  c10::SetCPUAllocator(the_allocator(), /*priority=*/200);
  return 0;
}

// Frees every kept block. Returns the bytes freed.
uint64_t rlhf_trl_tensor_cache_release() {
  Cache& c = cache();
  std::lock_guard<std::mutex> g(c.mu);
  return release_locked(c);
}

// Stops keeping blocks (frees the kept ones) and gives PyTorch its default CPU allocator back.
uint64_t rlhf_trl_tensor_cache_uninstall() {
  Cache& c = cache();
  uint64_t n;
  {
    std::lock_guard<std::mutex> g(c.mu);
    c.enabled = false;
    n = release_locked(c);
  }
  c10::SetCPUAllocator(c10::GetDefaultCPUAllocator(), /*priority=*/200);
  return n;
}

// out[0..7] = bytes kept now, hits, misses, live blocks, live bytes, most live bytes, bytes of kept blocks' pages
// moved into misses, mappings the live and kept blocks are made of.
void rlhf_trl_tensor_cache_stats(uint64_t* out) {
  Cache& c = cache();
  std::lock_guard<std::mutex> g(c.mu);
  out[0] = c.cached;
  out[1] = c.hits;
  out[2] = c.misses;
  out[3] = c.live.size();
  out[4] = c.live_bytes;
  out[5] = c.peak_live;
  out[6] = c.recycled;
  out[7] = c.mappings;
}

}
