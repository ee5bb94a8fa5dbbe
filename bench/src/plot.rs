//! Charts for the experiments, each written as SVG and PNG (plotters; text laid out with
//! ab_glyph from the DejaVu Sans font that scripts/setup.sh installs): lines for measurements
//! over a numeric axis, grouped bars for categories. Axis labels print integers as integers,
//! margins leave room for the last label, and windows (a congestion period) are shaded.

use std::path::Path;
use std::sync::Once;

use anyhow::{bail, Context as _};
use plotters::coord::Shift;
use plotters::prelude::*;

/// Where the font comes from (Debian's fonts-dejavu-core).
pub const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// Chart size in pixels.
const SIZE: (u32, u32) = (960, 540);

fn register_font() -> anyhow::Result<()> {
    static ONCE: Once = Once::new();
    static mut RESULT: Option<String> = None;
    ONCE.call_once(|| {
        let r = std::fs::read(FONT)
            .map_err(|e| {
                format!("reading {FONT} (scripts/setup.sh installs fonts-dejavu-core): {e}")
            })
            .and_then(|bytes| {
                // plotters keeps registered fonts for the life of the process.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                    .map_err(|_| format!("{FONT} is not a usable font"))
            });
        // SAFETY: written once inside call_once, read only after it.
        unsafe { RESULT = r.err() };
    });
    // SAFETY: ONCE has completed; RESULT is never written again.
    match unsafe { (*std::ptr::addr_of!(RESULT)).clone() } {
        Some(e) => bail!(e),
        None => Ok(()),
    }
}

/// One line of a chart, or one bar per category of a bar chart.
pub struct Series {
    /// Legend label.
    pub label: String,
    /// Points (x, y); for bars, x is the category's index.
    pub points: Vec<(f64, f64)>,
}

/// Chart options.
pub struct Chart<'a> {
    /// Caption drawn above the plot; also names the chart in "nothing to plot" errors.
    pub title: &'a str,
    /// X axis label.
    pub x_label: &'a str,
    /// Y axis label.
    pub y_label: &'a str,
    /// Logarithmic y axis.
    pub log_y: bool,
    /// Shaded x ranges `(from, to, label)`, e.g. while the host is congested.
    pub windows: Vec<(f64, f64, String)>,
}

/// An axis value as people write it: integers without a fraction (`10000`, not `10000.0`),
/// others with at most three significant decimals.
pub fn axis_number(v: f64) -> String {
    if !v.is_finite() {
        return String::new();
    }
    if (v - v.round()).abs() < 1e-9 * v.abs().max(1.0) || v.abs() >= 100.0 {
        return format!("{:.0}", v.round());
    }
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

const COLORS: [RGBColor; 6] = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];

/// The y range the series need (with room above the highest point).
fn y_range(series: &[Series], log_y: bool, floor_zero: bool) -> (f64, f64) {
    let (mut y0, mut y1) = (f64::MAX, f64::MIN);
    for &(_, y) in series.iter().flat_map(|s| s.points.iter()) {
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if y0 > y1 {
        return (0.0, 1.0);
    }
    if log_y {
        let lo = y0.max(1e-3) / 1.5;
        (lo, y1.max(lo * 10.0) * 1.5)
    } else {
        let lo = if floor_zero { y0.min(0.0) } else { y0 };
        (lo, if y1 <= lo { lo + 1.0 } else { y1 * 1.1 })
    }
}

/// Draws `series` as lines with points into `path` (`.svg`) and beside it as `.png`.
pub fn lines(path: &Path, chart: &Chart<'_>, series: &[Series]) -> anyhow::Result<()> {
    register_font()?;
    let (mut x0, mut x1) = (f64::MAX, f64::MIN);
    for &(x, _) in series.iter().flat_map(|s| s.points.iter()) {
        x0 = x0.min(x);
        x1 = x1.max(x);
    }
    if x0 > x1 {
        bail!("nothing to plot for {}", chart.title);
    }
    if x0 == x1 {
        x1 = x0 + 1.0;
    }
    let (y0, y1) = y_range(series, chart.log_y, true);
    let svg = SVGBackend::new(path, SIZE).into_drawing_area();
    draw_lines(svg, chart, series, (x0, x1), (y0, y1))?;
    let png_path = path.with_extension("png");
    let png = BitMapBackend::new(&png_path, SIZE).into_drawing_area();
    draw_lines(png, chart, series, (x0, x1), (y0, y1))
        .with_context(|| format!("writing {}", png_path.display()))?;
    Ok(())
}

fn draw_lines<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    chart: &Chart<'_>,
    series: &[Series],
    (x0, x1): (f64, f64),
    (y0, y1): (f64, f64),
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).context("drawing")?;
    macro_rules! draw {
        ($ctx:expr) => {{
            let mut ctx = $ctx;
            ctx.configure_mesh()
                .x_desc(chart.x_label)
                .y_desc(chart.y_label)
                .x_label_formatter(&|v| axis_number(*v))
                .y_label_formatter(&|v| axis_number(*v))
                .draw()
                .context("drawing axes")?;
            for (from, to, label) in &chart.windows {
                let shade = RGBColor(255, 140, 0).mix(0.18);
                ctx.draw_series(std::iter::once(Rectangle::new(
                    [(*from, y0), (*to, y1)],
                    shade.filled(),
                )))
                .context("drawing a window")?
                .label(label.as_str())
                .legend(move |(lx, ly)| {
                    Rectangle::new([(lx, ly - 6), (lx + 16, ly + 6)], shade.filled())
                });
            }
            for (i, s) in series.iter().enumerate() {
                let c = COLORS[i % COLORS.len()];
                ctx.draw_series(LineSeries::new(s.points.iter().copied(), c.stroke_width(2)))
                    .context("drawing a series")?
                    .label(s.label.as_str())
                    .legend(move |(lx, ly)| {
                        PathElement::new(vec![(lx, ly), (lx + 16, ly)], c.stroke_width(2))
                    });
                if s.points.len() <= 40 {
                    ctx.draw_series(s.points.iter().map(|&p| Circle::new(p, 3, c.filled())))
                        .context("drawing points")?;
                }
            }
            ctx.configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperRight)
                .draw()
                .context("drawing the legend")?;
        }};
    }
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(chart.title, ("sans-serif", 22))
        .margin(12)
        .margin_right(48)
        .x_label_area_size(48)
        .y_label_area_size(84);
    if chart.log_y {
        draw!(builder
            .build_cartesian_2d(x0..x1, (y0..y1).log_scale())
            .context("building the chart")?);
    } else {
        draw!(builder
            .build_cartesian_2d(x0..x1, y0..y1)
            .context("building the chart")?);
    }
    root.present().context("writing the chart")?;
    Ok(())
}

/// Draws grouped bars, one group per category and one bar per series (a series' point `(i, y)`
/// is its value for category `i`), into `path` (`.svg`) and beside it as `.png`.
pub fn bars(
    path: &Path,
    chart: &Chart<'_>,
    categories: &[String],
    series: &[Series],
) -> anyhow::Result<()> {
    register_font()?;
    if categories.is_empty() || series.is_empty() {
        bail!("nothing to plot for {}", chart.title);
    }
    let (y0, y1) = y_range(series, chart.log_y, true);
    let svg = SVGBackend::new(path, SIZE).into_drawing_area();
    draw_bars(svg, chart, categories, series, (y0, y1))?;
    let png_path = path.with_extension("png");
    let png = BitMapBackend::new(&png_path, SIZE).into_drawing_area();
    draw_bars(png, chart, categories, series, (y0, y1))
        .with_context(|| format!("writing {}", png_path.display()))?;
    Ok(())
}

fn draw_bars<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    chart: &Chart<'_>,
    categories: &[String],
    series: &[Series],
    (y0, y1): (f64, f64),
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).context("drawing")?;
    let n = categories.len() as f64;
    let width = 0.8 / series.len() as f64;
    let label_of = |v: &f64| {
        // Category names sit under the middle of their group.
        let i = v.round();
        if (v - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < categories.len() {
            categories[i as usize].clone()
        } else {
            String::new()
        }
    };
    macro_rules! draw {
        ($ctx:expr, $bottom:expr) => {{
            let mut ctx = $ctx;
            ctx.configure_mesh()
                .x_desc(chart.x_label)
                .y_desc(chart.y_label)
                .x_labels(categories.len() * 2 + 1)
                .x_label_formatter(&label_of)
                .y_label_formatter(&|v| axis_number(*v))
                .disable_x_mesh()
                .draw()
                .context("drawing axes")?;
            for (k, s) in series.iter().enumerate() {
                let c = COLORS[k % COLORS.len()];
                let left = -0.4 + k as f64 * width;
                ctx.draw_series(s.points.iter().map(|&(i, y)| {
                    Rectangle::new(
                        [(i + left, $bottom), (i + left + width * 0.9, y)],
                        c.mix(0.8).filled(),
                    )
                }))
                .context("drawing bars")?
                .label(s.label.as_str())
                .legend(move |(lx, ly)| {
                    Rectangle::new([(lx, ly - 6), (lx + 16, ly + 6)], c.mix(0.8).filled())
                });
            }
            ctx.configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperLeft)
                .draw()
                .context("drawing the legend")?;
        }};
    }
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(chart.title, ("sans-serif", 22))
        .margin(12)
        .margin_right(48)
        .x_label_area_size(48)
        .y_label_area_size(84);
    let xs = -0.6..(n - 0.4);
    if chart.log_y {
        draw!(
            builder
                .build_cartesian_2d(xs, (y0..y1).log_scale())
                .context("building the chart")?,
            y0
        );
    } else {
        draw!(
            builder
                .build_cartesian_2d(xs, y0..y1)
                .context("building the chart")?,
            y0
        );
    }
    root.present().context("writing the chart")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_numbers_read_as_people_write_them() {
        assert_eq!(axis_number(10000.0), "10000");
        assert_eq!(axis_number(2.0), "2");
        assert_eq!(axis_number(0.5), "0.5");
        assert_eq!(axis_number(1.25), "1.25");
        assert_eq!(axis_number(123.4), "123");
        assert_eq!(axis_number(0.1 + 0.2), "0.3");
    }

    fn font_or_skip(test: &str) -> bool {
        if std::fs::metadata(FONT).is_err() {
            eprintln!(
                "SKIPPED {test}: {FONT} missing (scripts/setup.sh installs fonts-dejavu-core)"
            );
            return false;
        }
        true
    }

    #[test]
    fn renders_lines_with_a_shaded_window_as_svg_and_png() {
        if !font_or_skip("renders_lines") {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.svg");
        let chart = Chart {
            title: "t",
            x_label: "x",
            y_label: "y",
            log_y: false,
            windows: vec![(1.2, 1.6, "congested".into())],
        };
        let s = vec![Series {
            label: "a".into(),
            points: vec![(1.0, 10000.0), (2.0, 20000.0)],
        }];
        lines(&path, &chart, &s).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("<polyline"));
        assert!(
            svg.lines().any(|l| l.trim() == "a"),
            "the legend names the series"
        );
        assert!(
            svg.lines().any(|l| l.trim() == "congested"),
            "the window is named"
        );
        assert!(
            svg.lines().any(|l| l.trim() == "10000"),
            "integers without .0"
        );
        assert!(!svg.contains("10000.0"));
        let png = std::fs::read(dir.path().join("t.png")).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    }

    #[test]
    fn renders_categories_as_bars() {
        if !font_or_skip("renders_categories_as_bars") {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.svg");
        let chart = Chart {
            title: "b",
            x_label: "handler",
            y_label: "ns",
            log_y: true,
            windows: vec![],
        };
        let cats: Vec<String> = ["add", "bsearch"].iter().map(|s| s.to_string()).collect();
        let s = vec![
            Series {
                label: "jit".into(),
                points: vec![(0.0, 10.0), (1.0, 40.0)],
            },
            Series {
                label: "interp".into(),
                points: vec![(0.0, 100.0), (1.0, 400.0)],
            },
        ];
        bars(&path, &chart, &cats, &s).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.contains("<rect"));
        for name in ["add", "bsearch", "jit", "interp"] {
            assert!(svg.lines().any(|l| l.trim() == name), "{name}");
        }
        assert!(
            !svg.lines().any(|l| l.trim() == "0.5"),
            "no fractional category ticks"
        );
        assert!(dir.path().join("b.png").is_file());
    }
}
