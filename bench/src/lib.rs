pub mod ycsb;
