/* Does copying 64 MiB out of a memory file's mapping (as a zero-copy
 * readback's binary is) cost more than out of anonymous memory? Copies into
 * a fresh destination each time, then into a warm one (docs/latency.md,
 * "Zero-copy readbacks, landed"):
 *
 *   cc -O2 -o /tmp/mapped_copy bench/mapped_copy.c && /tmp/mapped_copy
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <time.h>
#define N (64UL<<20)
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(){
  int fd=memfd_create("x",0); ftruncate(fd,N);
  char*w=mmap(0,N,PROT_READ|PROT_WRITE,MAP_SHARED,fd,0); memset(w,1,N);
  char*r=mmap(0,N,PROT_READ,MAP_SHARED|MAP_POPULATE,fd,0);
  char*a=aligned_alloc(2<<20,N); madvise(a,N,MADV_HUGEPAGE); memset(a,1,N);
  char*a4=mmap(0,N,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0); madvise(a4,N,MADV_NOHUGEPAGE); memset(a4,1,N);
  for(int warm=0;warm<2;warm++){
  double t[3][9]; char*wd=0;
  for(int i=0;i<9;i++){
    char*srcs[3]={r,a,a4};
    for(int k=0;k<3;k++){
      char*d=wd;
      if(!d){d=aligned_alloc(2<<20,N); madvise(d,N,MADV_HUGEPAGE); if(warm){memset(d,0,N); wd=d;}}
      double s=now(); memcpy(d,srcs[k],N); t[k][i]=N/(now()-s)/1e9; if(!warm) free(d);}
  }
  const char*nm[3]={"memfd map (4K shmem)","anon THP","anon 4K"};
  for(int k=0;k<3;k++){qsort(t[k],9,sizeof(double),cmp);printf("%s destination, from %s: %.2f GB/s\n",warm?"warm":"fresh",nm[k],t[k][4]);}
  }
}
