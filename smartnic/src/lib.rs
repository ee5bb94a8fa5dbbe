//! # naam-smartnic
//!
//! The SmartNIC side of a NAAM deployment: `naam-nic` runs the NIC executors and the one-sided
//! agent. On a BlueField-2 it runs on the DPU's Arm cores; here it is a process on the same
//! machine that maps the host's regions through shared memory and models the Arm cores and the
//! PCIe DMA with [`NicModel`] (see `smartnic/README.md` for the model and what is emulated).
#![deny(missing_docs)]

use naam_runtime::cluster::NicModel;
use naam_runtime::proto::step::DmaModel;

/// The emulation model of BlueField-2 Arm A72 cores and their DMA to host memory.
///
/// - Cores: 8 Arm Cortex-A72 at 2.0–2.75 GHz. A handler runs about 2× slower than on a
///   server x86 core (lower clock, narrower core, the interpreter instead of the x86 JIT):
///   `core_slowdown` = 2.0, applied by busy-waiting the extra time after each message.
/// - DMA: every fetch of host memory is one PCIe round trip, about 1 µs for a small read
///   across PCIe Gen4, plus ~10 GB/s per engine (100 ps per byte).
///
/// These are published-figure models, not measurements: nothing here ran on a BlueField-2.
pub fn bluefield2_model(core_slowdown: f64, dma_access_ns: u64, emulate: bool) -> NicModel {
    let mut model = NicModel::default();
    model.dma = DmaModel::new(dma_access_ns, 100);
    model.core_slowdown = core_slowdown;
    model.emulate_costs = emulate;
    model
}

/// What the BlueField-2 eSwitch rules steer.
#[derive(Clone, Debug)]
pub struct EswitchRules {
    /// The host's IP address (NAAM's server address).
    pub host_ip: std::net::Ipv4Addr,
    /// naam-server's UDP port.
    pub server_port: u16,
    /// naam-nic's UDP port on the Arm cores.
    pub nic_port: u16,
    /// Share of NAAM requests for the Arm cores, per mille.
    pub nic_permille: u32,
    /// OVS bridge on the DPU.
    pub bridge: String,
    /// Uplink representor (the wire).
    pub uplink: String,
    /// Host PF representor.
    pub host_rep: String,
    /// Representor of the scalable function the Arm-side naam-nic listens on.
    pub arm_rep: String,
}

impl EswitchRules {
    /// OVS commands: a select group splitting NAAM traffic by weight between the host PF and
    /// the Arm cores (rewriting the UDP port for the NIC), and the flow sending NAAM requests to it.
    pub fn ovs(&self) -> String {
        let nic = self.nic_permille.min(1000);
        let host = 1000 - nic;
        let mut out = String::new();
        out += "# BlueField-2 eSwitch (OVS, switchdev mode, hardware offload): NAAM requests\n";
        out += &format!(
            "# to {}:{} split {}‰ host / {}‰ Arm cores. The hardware hashes whole flows\n",
            self.host_ip, self.server_port, host, nic
        );
        out += "# (client address and port), not single requests as the XDP eSwitch does.\n";
        out += "ovs-vsctl set Open_vSwitch . other_config:hw-offload=true\n";
        out += &format!(
            "ovs-ofctl -O OpenFlow15 add-group {b} 'group_id={g},type=select,selection_method=hash,fields(ip_src,udp_src),bucket=bucket_id:0,weight:{host},actions=output:{hr},bucket=bucket_id:1,weight:{nic},actions=set_field:{np}->udp_dst,output:{ar}'\n",
            b = self.bridge,
            g = self.server_port,
            hr = self.host_rep,
            np = self.nic_port,
            ar = self.arm_rep,
        );
        out += &format!(
            "ovs-ofctl -O OpenFlow15 add-flow {b} 'table=0,priority=100,in_port={u},udp,nw_dst={ip},tp_dst={sp},actions=group:{g}'\n",
            b = self.bridge,
            u = self.uplink,
            ip = self.host_ip,
            sp = self.server_port,
            g = self.server_port,
        );
        out += &format!(
            "# Replies and one-sided traffic from the Arm cores leave through the uplink:\novs-ofctl -O OpenFlow15 add-flow {b} 'table=0,priority=100,in_port={ar},udp,udp_src={np},actions=output:{u}'\n",
            b = self.bridge,
            ar = self.arm_rep,
            np = self.nic_port,
            u = self.uplink,
        );
        out
    }

    /// tc flower commands on the uplink representor. tc flower has no weighted split: the rules
    /// send all NAAM requests one way (the NIC when the share is at least half), and the
    /// steering controller replaces them when the majority changes.
    pub fn tc(&self) -> String {
        let to_nic = self.nic_permille >= 500;
        let mut out = String::new();
        out += &format!(
            "# BlueField-2 eSwitch (tc flower on representors, offloaded with skip_sw): NAAM\n# requests to {}:{} all go to the {} (tc cannot split by weight).\n",
            self.host_ip,
            self.server_port,
            if to_nic { "Arm cores" } else { "host" }
        );
        out += &format!("tc qdisc add dev {} ingress\n", self.uplink);
        if to_nic {
            out += &format!(
                "tc filter add dev {u} ingress protocol ip prio 10 flower skip_sw ip_proto udp dst_ip {ip} dst_port {sp} action pedit ex munge udp dport set {np} pipe action csum udp pipe action mirred egress redirect dev {ar}\n",
                u = self.uplink,
                ip = self.host_ip,
                sp = self.server_port,
                np = self.nic_port,
                ar = self.arm_rep,
            );
        } else {
            out += &format!(
                "tc filter add dev {u} ingress protocol ip prio 10 flower skip_sw ip_proto udp dst_ip {ip} dst_port {sp} action mirred egress redirect dev {hr}\n",
                u = self.uplink,
                ip = self.host_ip,
                sp = self.server_port,
                hr = self.host_rep,
            );
        }
        out += &format!(
            "tc filter add dev {ar} ingress protocol ip prio 10 flower skip_sw ip_proto udp src_port {np} action mirred egress redirect dev {u}\n",
            ar = self.arm_rep,
            np = self.nic_port,
            u = self.uplink,
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(nic_permille: u32) -> EswitchRules {
        EswitchRules {
            host_ip: "192.168.100.2".parse().unwrap(),
            server_port: 7000,
            nic_port: 7001,
            nic_permille,
            bridge: "ovsbr1".into(),
            uplink: "p0".into(),
            host_rep: "pf0hpf".into(),
            arm_rep: "en3f0pf0sf0".into(),
        }
    }

    #[test]
    fn ovs_rules_split_by_the_share() {
        let o = rules(250).ovs();
        assert!(o.contains("weight:750,actions=output:pf0hpf"), "{o}");
        assert!(
            o.contains("weight:250,actions=set_field:7001->udp_dst,output:en3f0pf0sf0"),
            "{o}"
        );
        assert!(
            o.contains("nw_dst=192.168.100.2,tp_dst=7000,actions=group:7000"),
            "{o}"
        );
        assert!(rules(5000).ovs().contains("weight:0,actions=output:pf0hpf"));
    }

    #[test]
    fn tc_rules_follow_the_majority() {
        assert!(rules(800).tc().contains("munge udp dport set 7001"));
        assert!(rules(200).tc().contains("redirect dev pf0hpf"));
        assert!(!rules(200).tc().contains("munge"));
    }
}
